"""Persimmon (`PersimmonForCausalLM`: Adept's persimmon-8b-base / -chat), as transformers computes it: GPT-NeoX's
sequential layer (LayerNorms with biases; h = x + dense(attn(ln1(x))), out = h + mlp(ln2(h))), its per-head grouped
`query_key_value` with biases, a rotary over the first half of each head (`partial_rotary_factor` 0.5 by default),
with `qk_layernorm` one LayerNorm over head_dim (a weight and a bias shared by every head) on each head of q and of k
before the rotation, and a plain MLP with biases and a ReLU² activation (`dense_h_to_4h`, relu2, `dense_4h_to_h`);
the final norm `final_layernorm`, an untied head without a bias."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import DecoderSpec, norm_eps, rename_first
from .gpt_neox import GPTNeoXForCausalLM, GPTNeoXLayer, qkv_pieces, split_per_head_qkv
from .head_norm import HeadNormAttention
from .layers import RotaryEmbedding
from .plain_mlp import PlainMLP

_RENAMES = ((re.compile(r"^model\.final_layernorm\."), "model.norm."),
            (re.compile(r"^model\.layers\.(\d+)\.self_attn\.dense\."), r"model.layers.\1.self_attn.o_proj."))


class SharedHeadLayerNorm(nn.Module):
    """nn.LayerNorm(head_dim) applied to every head of x [T, heads * D] (F.layer_norm: fp32 inside, one rounding)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(head_dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.weight.shape[0]
        return F.layer_norm(x.view(x.shape[0], -1, d), (d,), self.weight, self.bias, self.eps).view(x.shape)


class PersimmonAttention(HeadNormAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        qk_norm = bool(getattr(hf_config, "qk_layernorm", True))
        super().__init__(hf_config, spec, layer_idx, rotary, None, norm_eps(hf_config))
        if qk_norm:  # HeadNormAttention's forward with these norms
            self.head_norm_names = ("q_layernorm", "k_layernorm")
            self.q_layernorm = SharedHeadLayerNorm(self.head_dim, norm_eps(hf_config))
            self.k_layernorm = SharedHeadLayerNorm(self.head_dim, norm_eps(hf_config))


class PersimmonLayer(GPTNeoXLayer):
    attention_class = PersimmonAttention
    parallel_by_default = False  # Persimmon's layer is sequential (its config has no use_parallel_residual)


class PersimmonForCausalLM(GPTNeoXForCausalLM):
    layer_class = PersimmonLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False, partial_rotary_factor=0.5)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("dense_h_to_4h", "dense_4h_to_h"), "Persimmon", ("relu2",), "relu2")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        heads = self.config.num_attention_heads
        yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".query_key_value",
                              lambda fused: split_per_head_qkv(name, fused, heads))
