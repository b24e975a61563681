"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2 / V3, Moonlight), as transformers computes it,
over the ordinary paged KV cache.

Per token: q = q_b_proj(RMSNorm(q_a_proj(x))) (or q_proj(x) without `q_lora_rank`), [H, nope + rope];
[c | k_rope] = kv_a_proj_with_mqa(x) ([kv_lora_rank + rope]: the latent c and one rotary key shared by every
head); [k_nope | v] = kv_b_proj(RMSNorm(c)) per head ([H, nope + v]). Each head attends with
q = [q_nope | rope(q_rope)], k = [k_nope | rope(k_rope)] and its own v, scaled by (nope + rope)^-0.5 (times
YaRN's mscale(factor, mscale_all_dim)^2 under YaRN), and o_proj maps the H x v outputs back.

The cache holds each head's expanded K and V (transformers' eager path, and what makes this an ordinary attention
for every backend and kernel here), not the latent: 2 x H x (nope + rope) elements a token and layer, V padded
with zeros to K's width (zero columns add nothing to a head's output, which is cut back to v_head_dim). That is
H x 384 / 576 = 85x the latent's bytes for DeepSeek-V3's 128 heads (docs/features.md: MLA's KV memory).

Layout: the rotary part is moved in front of each q head (checkpoint rows permuted by `rope_first`, and k built
so), so the shared rotary kernel rotates the first `qk_rope_head_dim` elements of a head, as for the partial-rope
models; a dot product does not depend on the order of its terms' pairs, so the scores are transformers'. The
rotary pairs are transformers' too: interleaved (2i, 2i + 1) for V2's complex rotation and V3's `rope_interleave`
(which only lays the same products out de-interleaved), rotate-half ones for V3 without it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...rope_settings import RopeSettings
from ..attention import Attention
from .layers import Linear, RMSNorm, RotaryEmbedding
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm and kv_a_layernorm: the RMSNorm default, not the config's


def mla_dims(hf_config) -> tuple[int, int, int]:
    """(qk_nope_head_dim, qk_rope_head_dim, v_head_dim) of an MLA config; ValueError where they cannot form heads
    (the value wider than the query/key heads it is padded to)."""
    nope, rope, v = (int(getattr(hf_config, name)) for name in ("qk_nope_head_dim", "qk_rope_head_dim",
                                                                   "v_head_dim"))
    if rope < 2 or rope % 2 or nope < 0 or not 1 <= v <= nope + rope:
        raise ValueError(f"MLA heads need an even qk_rope_head_dim >= 2 and 1 <= v_head_dim <= qk_nope_head_dim + "
                         f"qk_rope_head_dim, got {nope}, {rope}, {v}")
    return nope, rope, v


def mla_softmax_scale(hf_config, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN with `mscale_all_dim` (transformers' yarn_apply_mscale)."""
    scale = qk_head_dim**-0.5
    settings = RopeSettings.from_hf_config(hf_config)
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    mscale_all_dim = float(params.get("mscale_all_dim") or 0)
    if settings.rope_type == "yarn" and mscale_all_dim:
        mscale = 0.1 * mscale_all_dim * math.log(settings.factor) + 1.0 if settings.factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


def rope_first(weight: torch.Tensor, num_heads: int, nope: int, rope: int) -> torch.Tensor:
    """A q projection's rows [H * (nope + rope), ...] with each head's rope rows moved in front of its nope rows."""
    heads = weight.reshape(num_heads, nope + rope, *weight.shape[1:])
    return torch.cat([heads[:, nope:], heads[:, :nope]], dim=1).reshape(weight.shape)


class MlaAttention(nn.Module):
    """`self_attn` of a DeepSeek layer; parameters named as transformers' (q_a_proj, q_a_layernorm, q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj). Tensor parallelism splits the heads: q_b_proj / q_proj and
    kv_b_proj by output rows, o_proj by input columns; the latent projections and norms are replicated."""

    def __init__(self, hf_config, spec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden, total_heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.num_heads = divide(total_heads, get_tp_state().size, "num_attention_heads")  # this rank's
        self.nope, self.rope, self.v_head_dim = mla_dims(hf_config)
        self.head_dim = self.nope + self.rope  # q and k; v is padded to it in the cache
        self.kv_lora_rank = int(hf_config.kv_lora_rank)
        if rotary.head_dim != self.head_dim or rotary.rotary_dim != self.rope:
            raise ValueError(f"MLA needs a rotary of {self.rope} of {self.head_dim} elements, got "
                             f"{rotary.rotary_dim} of {rotary.head_dim}")
        bias = bool(getattr(hf_config, "attention_bias", False))
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        if q_lora_rank:
            self.q_a_proj = Linear(hidden, int(q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(int(q_lora_rank), [total_heads * self.head_dim])
        else:
            self.q_proj = ColumnParallelLinear(hidden, [total_heads * self.head_dim])
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, [total_heads * (self.nope + self.v_head_dim)])
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, hidden, bias=bias)
        self.rotary = rotary
        # every head its own K and V: as many KV heads as q heads (model_config.attention_shape)
        self.attn = Attention(layer_idx, self.num_heads, self.num_heads, self.head_dim,
                              mla_softmax_scale(hf_config, self.head_dim))

    def query(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H * (rope + nope)]
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def scale_query(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q as attention takes it: itself here; Mistral 4's query temperature (mistral4.py)."""
        return q

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input norm (after the deferred residual add), then MLA: (output [T, hidden], the residual)."""
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        q = self.scale_query(positions, self.query(x))  # [T, H * D], each head rope | nope (rope_first at load)
        return self.o_proj(self.attend(positions, x, q)), residual

    def attend(self, positions: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The normed input x [T, hidden] and its queries q [T, H * D] -> each head's output [T, H * v_head_dim]
        (before o_proj: A.X-K2 gates it there, deepseek.py)."""
        num_tokens, heads = x.shape[0], self.num_heads
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(num_tokens, heads, self.nope + self.v_head_dim)
        k = torch.cat([k_rope[:, None, :].expand(num_tokens, heads, self.rope), kv[..., : self.nope]], dim=-1)
        v = F.pad(kv[..., self.nope :], (0, self.head_dim - self.v_head_dim))  # [T, H, D], zeros past v_head_dim
        out = self.attn(positions, q, k.view(num_tokens, -1), v.view(num_tokens, -1), self.rotary)  # [T, H * D]
        return out.view(num_tokens, heads, self.head_dim)[..., : self.v_head_dim].reshape(num_tokens, -1)
