"""Jamba (`JambaForCausalLM`: AI21's Jamba v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large), as transformers computes it:
Llama's pre-norm layers whose mixer is attention without a positional encoding in the layers `layers_block_type`
calls attention (every `attn_layer_period`-th from `attn_layer_offset`), a Mamba-1 mixer elsewhere (mamba1.py, with
Jamba's weighted dt / B / C norms); the MLP a Mixtral-style mixture of experts (softmax over the experts, the top k
left unnormalised) where `layers_num_experts` says, a SwiGLU elsewhere.

Weights: `feed_forward` (the MLP: `router` the experts' gate, `experts.E.*` or stacked), `pre_ff_layernorm`,
`model.final_layernorm`; the mixer's `mamba.*` (mamba1.py). Tensor parallelism is refused (hybrid_facts)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...hybrid_facts import layer_types
from .decoder import BIASLESS, DecoderSpec
from .hybrid_layer import HybridLayer, feed_forward_names
from .mamba1 import Mamba1Mixer
from .qwen3_moe import Qwen3MoeForCausalLM
from .smollm3 import without_rotary


class JambaLayer(HybridLayer):
    linear_name, linear_class = "mamba", Mamba1Mixer


class JambaForCausalLM(Qwen3MoeForCausalLM):
    layer_class = JambaLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return BIASLESS

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)
        without_rotary(layer for layer in self.model.layers if not layer.linear)  # no positional encoding

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = feed_forward_names(name).split(".")
        if len(parts) > 4 and parts[3:5] == ["mlp", "router"]:  # the experts' gate
            parts[4] = "gate"
        return ((".".join(parts), tensor),)
