"""Bamba (`BambaForCausalLM`: IBM's Bamba-9B v1 / v2), as transformers computes it: Llama's pre-norm layers in which
the layers outside `attn_layer_indices` run a Mamba-2 mixer (mamba2.py, Granite 4.0-H's: transformers' Granite
mixer is Bamba's; a recurrent state per request, docs/hybrid_models.md) instead of attention; the attention layers
rotate half of each head (`partial_rotary_factor` 0.5, transformers' Bamba default); a SwiGLU MLP after each.

Weights: `model.layers.N.feed_forward.{gate,up,down}_proj` (the MLP), `pre_ff_layernorm` (the norm before it),
`model.final_layernorm` (the final norm), the mixer's `model.layers.N.mamba.*` as Granite 4.0-H's."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...hybrid_facts import layer_types
from .decoder import DecoderLM, DecoderSpec
from .hybrid_layer import HybridLayer, feed_forward_names
from .mamba2 import Mamba2Mixer


class BambaLayer(HybridLayer):
    linear_name, linear_class = "mamba", Mamba2Mixer


class BambaForCausalLM(DecoderLM):
    layer_class = BambaLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
                           o_bias=bool(getattr(hf_config, "attention_bias", False)),
                           mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False,
                           partial_rotary_factor=0.5)

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((feed_forward_names(name), tensor),)
