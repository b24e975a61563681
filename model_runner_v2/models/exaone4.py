"""EXAONE 4.0 (`Exaone4ForCausalLM`: EXAONE-4.0-1.2B / 32B), as transformers' Exaone4 computes it: OLMo 2's layer order
(no norm before a sub-block, RMSNorms after attention and after the MLP, olmo2.Olmo2Layer) with Llama's RMSNorm order,
per-head q/k RMSNorms before the rotation (Qwen3's, fused with it), and, where the config names a `sliding_window`,
a window in the layers `layer_types` calls sliding and no rotary in the others (transformers' "global NoPE"; an
identity rotary, as SmolLM3's NoPE layers: smollm3.without_rotary). Without a window every layer rotates and
attends to everything."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderAttention, DecoderLM, DecoderSpec
from .olmo2 import Olmo2Layer, Olmo2MLP
from .smollm3 import without_rotary


def global_nope(layers: nn.ModuleList, hf_config) -> None:
    """EXAONE 4's "global NoPE": with a `sliding_window`, the layers `layer_types` does not call sliding rotate
    nothing (without a window every layer rotates). K-EXAONE's too (exaone_moe.py)."""
    if getattr(hf_config, "sliding_window", None) is None:
        return
    types = list(getattr(hf_config, "layer_types", None) or [])
    if len(types) != hf_config.num_hidden_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {hf_config.num_hidden_layers} layers")
    without_rotary(layer for layer, kind in zip(layers, types) if kind != "sliding_attention")


class Exaone4Attention(DecoderAttention):
    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], no norm first
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm))


class Exaone4Layer(Olmo2Layer):
    attention_class = Exaone4Attention
    norm_weight_in_fp32 = False


class Exaone4ForCausalLM(DecoderLM):
    layer_class = Exaone4Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        global_nope(self.model.layers, hf_config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return Olmo2MLP(self.config, self.spec(self.config))
