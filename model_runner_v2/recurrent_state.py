"""Hybrid models' recurrent state (docs/hybrid_models.md): per linear-attention layer, one row per request slot (and
one for the CUDA graphs' padding slot) of its convolution history and (but for LFM2's short convolution) its
delta-rule / SSM state, allocated beside the KV cache and bound to the layers (models/recurrent_layer.py: they read
them through ForwardContext's req_slots)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import EngineConfig
from ..hybrid_facts import RecurrentShape
from .models.recurrent_layer import RecurrentLayer


def state_specs(config: EngineConfig) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every state tensor, per linear-attention layer in layer order: the convolution history
    [slots, K - 1, conv_dim] in the model's dtype, then the recurrent state [slots, *RecurrentShape.state_dims] in
    fp32 (transformers keeps it so in every dtype; none for LFM2's short convolution). slots = max_num_seqs + 1: the
    request slots and the padding slot."""
    mc = config.model_config
    if not mc.recurrent_layers:
        return []
    shape = RecurrentShape.of(mc.architecture, mc.hf_config).for_rank(config.tensor_parallel_size)  # this rank's
    slots = config.max_num_seqs + 1
    one = [(shape.conv_state_shape(slots), mc.dtype)]
    if shape.state_dims is not None:
        one.append((shape.recurrent_state_shape(slots), torch.float32))
    return one * len(mc.recurrent_layers)


def state_bytes(config: EngineConfig) -> int:
    """Device bytes of all the recurrent state: the KV cache's budget less them (kv_cache.determine_num_blocks)."""
    total = 0
    for shape, dtype in state_specs(config):
        numel = 1
        for s in shape:
            numel *= s
        total += numel * dtype.itemsize
    return total


def allocate_states(config: EngineConfig) -> list[torch.Tensor]:
    """Zero-filled state tensors (state_specs' order)."""
    return [torch.zeros(shape, dtype=dtype, device=config.torch_device) for shape, dtype in state_specs(config)]


def bind_states(model: nn.Module, states: list[torch.Tensor]) -> None:
    """Hand each linear-attention layer (models/recurrent_layer.RecurrentLayer) its tensors, in layer order: the
    convolution history, then the recurrent state where the layer keeps one (`has_state`)."""
    layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
    if len(states) != sum(1 + layer.has_state for layer in layers):
        raise RuntimeError(f"{len(states)} state tensors for {len(layers)} linear-attention layers")
    i = 0
    for layer in layers:
        layer.bind_state(states[i], states[i + 1] if layer.has_state else None)
        i += 1 + layer.has_state
