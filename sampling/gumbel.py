"""Counter-based random numbers for sampling: noise depends only on (seed, position, token id).

A request's draws are therefore the same whatever else is in the batch, on any device, without a
torch.Generator per request (which cannot be batched)."""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply rounds) on int64 tensors holding uint32 values.
    Products may wrap past 2**63; only the low 32 bits are kept, which wrapping preserves."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds [R] int64, positions [R] int64 -> Gumbel(0, 1) noise [R, V] float32.

    argmax(logits / T + noise) is an exact sample from softmax(logits / T) (the Gumbel-max trick)."""
    seed_lo = seeds & _M32
    seed_hi = (seeds >> 32) & _M32
    key = _mix32(_mix32(seed_lo ^ _mix32(seed_hi + 0x3C6EF372)) ^ (positions & _M32))  # [R]
    idx = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = _mix32((key[:, None] + idx[None, :] * 0x9E3779B9) & _M32)
    h = _mix32(h ^ key[:, None])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    # 2**24 - 0.5 rounds up to 2**24 in fp32, so the top hash gave u == 1.0 and +inf noise (the token won whatever
    # its logit, ~1% of steps over a 150k vocabulary; a -inf masked logit became nan): keep u below 1.
    u = u.clamp_(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log(u))
