"""Qwen2-MoE causal LM (`Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) and
Qwen3-MoE's layer plan and routed experts, plus a shared expert in every sparse layer: a dense SwiGLU of width
`shared_expert_intermediate_size` that every token runs, gated per token by sigmoid(shared_expert_gate(x)):
out = routed + sigmoid(gate(x)) * shared(x), as transformers computes it.

Weights: the routed experts as Qwen3-MoE's; `mlp.shared_expert.{gate,up}_proj.weight` land in the shared expert's
fused gate_up_proj (its own width: not the dense layers' `intermediate_size`), `mlp.shared_expert.down_proj.weight`
and `mlp.shared_expert_gate.weight` [1, H] as named."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.activation import sigmoid
from .decoder import DecoderMLP, DecoderSpec
from .layers import Linear
from .moe import SparseMoeBlock
from .qwen2 import Qwen2ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

_SHARED_PARTS = {"gate_proj": 0, "up_proj": 1}  # part -> its place in the shared expert's fused gate_up_proj
_SHARED_NAMES = ("shared_expert", "shared_experts")  # Qwen2-MoE's module name, GLM-4-MoE's


class SharedExpertMoeBlock(SparseMoeBlock):
    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        width = int(hf_config.shared_expert_intermediate_size)
        self.shared_expert = DecoderMLP(hf_config, spec, intermediate_size=width)  # tensor-parallel as a dense MLP
        self.shared_expert_gate = Linear(hf_config.hidden_size, 1)  # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)
        shared = self.shared_expert.down(self.shared_expert.gate_up_proj(x))
        return routed + sigmoid(self.shared_expert_gate(x), self.batch_invariant) * shared


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return Qwen2ForCausalLM.spec(hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return SharedExpertMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def weight_target(self, name: str, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int] | None:
        # model.layers.N.mlp.shared_expert.{gate,up}_proj.weight -> rows of ...shared_expert.gate_up_proj.weight
        # (GLM-4-MoE's module is named shared_experts)
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3] in _SHARED_NAMES and parts[-2] in _SHARED_PARTS:
            target = ".".join(parts[:-2] + ["gate_up_proj", parts[-1]])
            if target not in params:
                raise ValueError(f"tensor {name!r} matches no parameter of {type(self).__name__}")
            width = params[target].shape[0] // 2  # this rank's share of the shared expert's width
            return target, _SHARED_PARTS[parts[-2]] * width, width
        return super().weight_target(name, params, shards)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)
        for name, param in params.items():
            if any(f".{shared}.gate_up_proj." in name for shared in _SHARED_NAMES):
                pieces[name] = {0, param.shape[0] // 2}  # its gate rows and its up rows
        return pieces
