"""SmolLM3 causal LM (`SmolLM3ForCausalLM`, HF's SmolLM3-3B): Llama's layers, where the layers that
`no_rope_layers` marks 0 (every 4th in the released config) apply no rotary embedding ("NoPE").

A NoPE layer's attention gets a rotary whose cache is cos = 1, sin = 0: q * 1 + rotate_half(q) * 0 is q itself
(the only bit that can differ is a -0.0 turned +0.0), so the fused rope + KV-write kernel and the torch path
serve those layers unchanged and the cache holds the un-rotated K, as transformers' cache does."""

from __future__ import annotations

import torch

from ...rope_settings import RopeSettings
from .layers import RotaryEmbedding
from .llama import LlamaForCausalLM


def identity_rotary(like: RotaryEmbedding, same_layout: bool = False) -> RotaryEmbedding:
    """A rotary over the same positions and head size that rotates nothing (default settings: nothing in them
    depends on the served context, so RotaryEmbedding.fit_context leaves its tables alone). same_layout: also
    `like`'s rotary_dim and pairing (MLA's attention checks its rotary's shape: Kimi Linear's NoPE layers)."""
    layout = dict(rotary_dim=like.rotary_dim, interleaved=like.interleaved) if same_layout else {}
    rotary = RotaryEmbedding(like.head_dim, like.cos_cache.shape[0], RopeSettings(theta=like.settings.theta), **layout)
    with torch.no_grad():
        rotary.cos_cache.fill_(1.0)
        rotary.sin_cache.zero_()
    return rotary


def without_rotary(layers) -> None:
    """The given decoder layers' attention rotates nothing (NoPE layers; every layer of a model with absolute
    positions): one identity rotary shared by all of them (its cache built once). No layers: nothing changes."""
    layers = list(layers)
    if layers:
        identity = identity_rotary(layers[0].self_attn.rotary)
        for layer in layers:
            layer.self_attn.rotary = identity


def rotary_in_sliding_layers_only(layers, hf_config) -> None:
    """The rotary in the layers `layer_types` calls sliding alone: the others rotate nothing, whether or not the
    config names a window (AFMoE's and Flint's full layers; EXAONE 4's rule, exaone4.global_nope, needs a window)."""
    without_rotary(layer for layer, kind in zip(layers, hf_config.layer_types) if kind != "sliding_attention")


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        uses_rope = list(getattr(hf_config, "no_rope_layers", None) or [1] * hf_config.num_hidden_layers)
        if len(uses_rope) != hf_config.num_hidden_layers:
            raise ValueError(f"config.json: no_rope_layers has {len(uses_rope)} entries for "
                             f"{hf_config.num_hidden_layers} layers")
        without_rotary(layer for layer, rope in zip(self.model.layers, uses_rope) if not rope)
