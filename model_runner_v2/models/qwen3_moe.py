"""Qwen3-MoE causal LM: Qwen3's attention; sparse layers (moe.py) where the config says, the dense MLP elsewhere.

Weights: HF checkpoints name each expert's tensors (model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight);
transformers >= 5 keeps them stacked in memory (model.layers.N.mlp.experts.{gate_up_proj [E, 2I, H], down_proj
[E, H, I]}), which is what LLM.load_weights(trainer_module) hands over. Both land in StackedExperts' rows."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...config import moe_facts
from .decoder import DecoderLM, DecoderSpec, rotary_per_layer_type
from .moe import SparseMoeBlock, StackedExperts
from .qwen3 import Qwen3ForCausalLM

_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


class Qwen3MoeForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return Qwen3ForCausalLM.spec(hf_config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts(type(self).__name__, self.config)  # {}: no sparse layer (Jamba's dense configs)
        if facts and layer_idx in facts["moe_layers"]:
            return self.sparse_block(layer_idx, facts)
        return super().build_mlp(layer_idx)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        """A sparse layer's MLP (facts: model_config.moe_facts); Qwen2-MoE's adds a shared expert."""
        return SparseMoeBlock(self.config, layer_idx, facts)

    def _experts(self, layer: int) -> StackedExperts:
        mlp = self.model.layers[layer].mlp
        if not isinstance(mlp, SparseMoeBlock):
            raise ValueError(f"layer {layer} of {type(self).__name__} is dense: it has no experts")
        return mlp.experts

    def weight_target(self, name: str, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int] | None:
        # model.layers.N.mlp.experts.E.<proj>.weight -> rows of model.layers.N.mlp.experts.{gate_up,down}_proj
        parts = name.split(".")
        if (len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[3:5] == ["mlp", "experts"]
                and parts[5].isdigit() and parts[6] in _EXPERT_PROJ and parts[7] == "weight"):
            experts = self._experts(int(parts[2]))
            e, inter, hidden = int(parts[5]), experts.intermediate_size, experts.hidden_size
            if e >= experts.num_experts:
                raise ValueError(f"tensor {name!r}: expert {e} >= num_experts={experts.num_experts}")
            prefix = ".".join(parts[:5])
            if parts[6] == "down_proj":
                return f"{prefix}.down_proj", e * hidden, hidden
            offset = e * 2 * inter + (inter if parts[6] == "up_proj" else 0)
            return f"{prefix}.gate_up_proj", offset, inter
        return super().weight_target(name, params, shards)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                ex, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
                pieces[f"{prefix}.gate_up_proj"] = set(range(0, ex.num_experts * 2 * ex.intermediate_size,
                                                             ex.intermediate_size))
                pieces[f"{prefix}.down_proj"] = set(range(0, ex.num_experts * ex.hidden_size, ex.hidden_size))
        return pieces


class MellumForCausalLM(Qwen3MoeForCausalLM):
    """JetBrains' Mellum 2: Qwen3-MoE's layers, sparse where `mlp_layer_types` says (the rest a dense SwiGLU of
    `intermediate_size`: moe_facts), a window in the layers `layer_types` calls sliding (model_config), a rope per
    kind of layer (`rope_parameters` keyed by layer type: the sliding layers' theta 1e4, the full ones' 5e5 by
    default); the multi-token-prediction layer (`mtp.*`) skipped, as transformers skips it."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return () if name.startswith("mtp.") else super().checkpoint_parts(name, tensor)
