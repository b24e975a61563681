"""The rotary callable of attention whose per-head q/k norms come *after* the rope (HunYuan's query / key
layernorms; Llama 4's L2 norms): Attention.forward's `rotary`, given the attention's norms where it has them.

The rope runs first (the model's RotaryEmbedding, its rounding), then the identity rotary (cos 1, sin 0: the
rotation changes no bit) with the norms in front of it: kernels/rotary.py's norm + rope + KV write, so on the fused
path the second launch also writes K and V to the cache. The rotary kernel's norm is Qwen3's (fp32 inside, rounded
to the model dtype, then times the weight), which is transformers' LlamaRMSNorm order."""

from __future__ import annotations

import torch
from torch import nn

from .layers import RotaryEmbedding


class RopeThenNorm(nn.Module):
    def __init__(self, rope: RotaryEmbedding, identity: RotaryEmbedding):
        super().__init__()
        self.rope, self.identity = rope, identity  # shared with the other layers

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None, kv_write=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, Hq, D], k [T, Hkv, D] -> (q [T, Hq*D], k [T, Hkv*D] or None after a fused KV write); q_norm /
        k_norm applied to the rotated heads."""
        head_dim = q.shape[-1]
        q, k = self.rope(positions, q, k)
        return self.identity(positions, q.view(q.shape[0], -1, head_dim), k.view(k.shape[0], -1, head_dim),
                             q_norm, k_norm, kv_write)
