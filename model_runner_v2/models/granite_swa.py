"""Granite with sliding windows and attention sinks (`GraniteSWAForCausalLM`, `GraniteMoeSWAForCausalLM`), as
transformers' GraniteSWA / GraniteMoeSWA compute them: Granite's (or Granite MoE Shared's) layers and scalars whose
attention has

- a window of `sliding_window` keys in the layers `layer_types` calls sliding (every fourth layer full by default:
  model_config);
- a learnable sink per q head (`self_attn.sinks`): transformers scales the softmax's output by
  sigmoid(logsumexp(scores) - sink), which is one more logit in the softmax's denominator attached to no value —
  GPT-OSS's sinks (Attention.enable_sinks, in every attention path);
- a rope base per layer (`layer_rope_theta`; 0: that layer rotates nothing): one RotaryEmbedding per base."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderSpec
from .granite import GraniteForCausalLM, GraniteLayer
from .granitemoe import GraniteMoeLayer
from .granitemoehybrid import GraniteMoeSharedForCausalLM
from .layers import RotaryEmbedding
from .parallel import get_tp_state, mark_sharded
from .smollm3 import identity_rotary


def rope_per_layer(layers: nn.ModuleList, hf_config) -> None:
    """`layer_rope_theta`: each layer's rope base (0: no rope); layers of one base share one RotaryEmbedding."""
    thetas = list(getattr(hf_config, "layer_rope_theta", None) or [])
    if not thetas:
        return
    if len(thetas) != len(layers):
        raise ValueError(f"config.json: layer_rope_theta has {len(thetas)} entries for {len(layers)} layers")
    base = layers[0].self_attn.rotary
    rotaries: dict[float, RotaryEmbedding] = {base.settings.theta: base}
    for layer, theta in zip(layers, thetas):
        theta = float(theta)
        if theta not in rotaries:
            rotaries[theta] = identity_rotary(base) if theta == 0 else RotaryEmbedding(
                base.head_dim, base.cos_cache.shape[0], dataclasses.replace(base.settings, theta=theta),
                interleaved=base.interleaved, fp32_math=base.fp32_math, fp32_tables=base.fp32_tables)
        layer.self_attn.rotary = rotaries[theta]


def _sinks_renamed(name: str) -> str:
    return name[: -len(".self_attn.sinks")] + ".self_attn.attn.sinks" if name.endswith(".self_attn.sinks") else name


class _SinksLayer(nn.Module):
    """Mixed in before a Granite layer class: its attention gets a sink per head (this rank's heads')."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.self_attn.attn.enable_sinks()
        mark_sharded(self.self_attn.attn.sinks, 0, get_tp_state(), hf_config.num_attention_heads)


class _SWAModel(nn.Module):
    """Mixed in before a Granite model class: a rope base per layer, the checkpoint's sinks renamed."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rope_per_layer(self.model.layers, hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().checkpoint_parts(_sinks_renamed(name), tensor)


class GraniteSWALayer(_SinksLayer, GraniteLayer):
    pass


class GraniteSWAForCausalLM(_SWAModel, GraniteForCausalLM):
    layer_class = GraniteSWALayer


class GraniteMoeSWALayer(_SinksLayer, GraniteMoeLayer):
    pass


class GraniteMoeSWAForCausalLM(_SWAModel, GraniteMoeSharedForCausalLM):
    layer_class = GraniteMoeSWALayer
