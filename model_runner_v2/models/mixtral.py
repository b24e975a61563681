"""Mixtral causal LM: Mistral's attention (Llama's layers, no biases, an optional sliding window) and a sparse MoE
block in every layer (moe.py: fp32 softmax over the experts, top-k, renormalised; the experts' SwiGLU).

Weights: HF checkpoints name the block `block_sparse_moe` and each expert's tensors w1 (gate), w3 (up) and w2
(down): model.layers.N.block_sparse_moe.{gate.weight, experts.E.w1.weight, ...}. transformers >= 5 names the
same module `mlp` in memory and keeps the experts stacked (mlp.experts.{gate_up_proj [E, 2I, H], down_proj
[E, H, I]}), which is what LLM.load_weights(trainer_module) hands over. `checkpoint_parts` renames the former to
the latter's names (Qwen3-MoE's), which Qwen3MoeForCausalLM's weight mapping places."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .decoder import DecoderSpec
from .llama import LlamaForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(Qwen3MoeForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return LlamaForCausalLM.spec(hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((block_sparse_moe_name(name), tensor),)


def block_sparse_moe_name(name: str) -> str:
    """Mixtral's MoE names as the engine's (Kimi Linear's files use them too):
    model.layers.N.block_sparse_moe.gate.weight         -> model.layers.N.mlp.gate.weight
    model.layers.N.block_sparse_moe.experts.E.w1.weight -> model.layers.N.mlp.experts.E.gate_proj.weight"""
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "block_sparse_moe":
        parts[3] = "mlp"
        if len(parts) == 8 and parts[4] == "experts" and parts[6] in _EXPERT_NAMES:
            parts[6] = _EXPERT_NAMES[parts[6]]
    return ".".join(parts)
