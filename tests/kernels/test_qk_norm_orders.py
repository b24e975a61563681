"""The per-head q/k norm's weight step inside the rope kernel (kernels/rotary.py, through the RMSNorm kernel's
`weigh`): Llama's / Qwen3's
(normed row cast, then times the weight), OLMo 2's (the weight times the fp32 row, one cast) and Gemma 3's ((1 +
weight) times the fp32 row, one cast). The Triton kernel (interpreter here; compiled in the `gpu` test) against the
torch reference with the same flags, the reference against transformers' Gemma3RMSNorm bit for bit, and the orders
told apart (a kernel that ignored the flag would fail)."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol
from transformers.models.gemma3 import modeling_gemma3

from replayllm.kernels.rotary import KVWrite, qk_norm_rope_torch, qk_norm_rope_triton

ORDERS = {"llama": {}, "fp32_weight": dict(norm_weight_in_fp32=True),
          "unit_offset": dict(norm_weight_in_fp32=True, norm_unit_offset=True)}


def _case(dtype, device="cpu", num_tokens=5, num_heads=4, num_kv_heads=2, head_dim=32, seed=0):
    """q/k/v as strided views of one qkv projection [T, (Hq + 2Hkv) * D]; weights around 0 (Gemma's are stored
    as offsets from 1) so the three orders give far apart values."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2).to(dtype)
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.to(device).split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(300).float(), inv_freq)
    positions = torch.randint(0, 300, (num_tokens,), generator=g)
    qw, kw = ((torch.randn(head_dim, generator=g) * 0.5).to(dtype).to(device) for _ in range(2))
    return positions.to(device), q, k, v, freqs.cos().to(device), freqs.sin().to(device), qw, kw


def _assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, head_dim: int) -> None:
    """As test_fused_kernels' q/k norm + rope check: the per-head mean of squares is summed in another order."""
    assert got.shape == ref.shape and not got.isnan().any()
    if dtype == torch.float32:
        tol = rounding_tol(1, terms=head_dim, steps=2)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    else:
        assert (got.float() - ref.float()).abs().max() <= 4 * torch.finfo(dtype).eps * ref.abs().max().float()
        assert (got != ref).float().mean() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("order", list(ORDERS))
def test_each_norm_order_equals_the_reference(dtype, order):
    positions, q, k, _, cos, sin, qw, kw = _case(dtype)
    got = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS[order])
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS[order])
    for a, b in zip(got, ref):
        _assert_close(a, b, dtype, q.shape[-1])
    # every other order's reference differs from this output in more than 5% of the elements (in fp32 the cast
    # between Llama's two steps rounds nothing: Llama's order and OLMo 2's are one computation there)
    for other in ORDERS:
        if other == order or (dtype == torch.float32 and {order, other} == {"llama", "fp32_weight"}):
            continue
        elsewhere = qk_norm_rope_torch(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS[other])[0]
        assert (got[0] != elsewhere).float().mean() > 0.05, (order, other)


def test_unit_offset_reference_is_transformers_gemma3_norm():
    """qk_norm_rope_torch's unit-offset norm == transformers' Gemma3RMSNorm on each head, then the rotation."""
    positions, q, k, _, cos, sin, qw, kw = _case(torch.bfloat16)
    hf_q = modeling_gemma3.Gemma3RMSNorm(q.shape[-1], eps=1e-6)
    hf_q.weight.data = qw.float()  # transformers keeps it in fp32 and does (1 + weight.float())
    ref_q, _ = qk_norm_rope_torch(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS["unit_offset"])
    normed, _ = qk_norm_rope_torch(positions, hf_q(q), k, cos, sin)  # HF's norm, then the rotation alone
    assert torch.equal(ref_q, normed)


def test_kv_write_carries_the_unit_offset_norm():
    """With the KV write fused, the cache holds exactly the K the separate call returns (unit-offset norm)."""
    positions, q, k, v, cos, sin, qw, kw = _case(torch.bfloat16)
    cache = torch.zeros(2, 2, 16, k.shape[1], k.shape[2], dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, 0, 9, 30])
    q_fused, none = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, KVWrite(cache, v, slots),
                                        **ORDERS["unit_offset"])
    q_sep, k_sep = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS["unit_offset"])
    assert none is None and torch.equal(q_fused, q_sep)
    flat = cache.view(2, -1, k.shape[1] * k.shape[2])
    assert torch.equal(flat[0, slots], k_sep) and torch.equal(flat[1, slots], v.reshape(len(slots), -1))


@pytest.mark.gpu
@pytest.mark.parametrize("order", list(ORDERS))
def test_each_norm_order_on_cuda(order):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the compiled kernel)")
    positions, q, k, _, cos, sin, qw, kw = _case(torch.bfloat16, device="cuda", num_tokens=37, num_heads=4,
                                                 num_kv_heads=1, head_dim=256)  # Gemma-3-1B's heads
    got = qk_norm_rope_triton(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS[order])
    ref = qk_norm_rope_torch(positions, q, k, cos, sin, qw, kw, 1e-6, **ORDERS[order])
    for a, b in zip(got, ref):
        _assert_close(a, b, torch.bfloat16, q.shape[-1])
