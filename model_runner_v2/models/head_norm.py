"""Per-head q/k LayerNorms before rope (Command-R+'s `use_qk_norm`, StableLM-2-12B's `qk_layernorm`): each head of
q and k normalised over head_dim, mean-centred, times that head's own weight, no bias.

transformers computes both in fp32 with one rounding at the end: Cohere's CohereLayerNorm((heads, head_dim)) op
for op (upcast, mean, variance of the centred row, rsqrt, times the fp32 weight, cast), StableLM's ModuleList of
nn.LayerNorm(head_dim) through F.layer_norm (fp32 inside, one rounding). `PerHeadLayerNorm` is the former's ops on a
[heads, head_dim] weight; under tensor parallelism each rank holds its heads' rows."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderAttention, DecoderSpec
from .layers import RotaryEmbedding
from .parallel import divide, get_tp_state, mark_sharded


class PerHeadLayerNorm(nn.Module):
    def __init__(self, total_heads: int, head_dim: int, eps: float):
        super().__init__()
        state = get_tp_state()
        self.eps, self.head_dim = eps, head_dim
        self.weight = nn.Parameter(torch.empty(divide(total_heads, state.size, "heads"), head_dim),
                                   requires_grad=False)
        mark_sharded(self.weight, 0, state, total_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, heads * D] (this rank's heads) -> the same
        x32 = x.reshape(x.shape[0], -1, self.head_dim).float()  # [T, heads, D]
        centred = x32 - x32.mean(-1, keepdim=True)
        normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype).reshape(x.shape[0], -1)


class HeadNormAttention(DecoderAttention):
    """DecoderAttention with per-head LayerNorms on q and k after the projection, before rope; `names` are the
    checkpoint's module names for them (Cohere: q_norm / k_norm; StableLM: q_layernorm / k_layernorm), None: no
    such norms (the plain DecoderAttention)."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding,
                 names: tuple[str, str] | None, eps: float):
        super().__init__(hf_config, spec, layer_idx, rotary)
        total_kv = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
        self.head_norm_names = names
        if names:
            setattr(self, names[0], PerHeadLayerNorm(hf_config.num_attention_heads, self.head_dim, eps))
            setattr(self, names[1], PerHeadLayerNorm(total_kv, self.head_dim, eps))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.head_norm_names:
            return super().forward(positions, x, residual, norm)
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_norm, k_norm = (getattr(self, name) for name in self.head_norm_names)
        return self.o_proj(self.attn(positions, q_norm(q), k_norm(k), v, self.rotary)), residual
