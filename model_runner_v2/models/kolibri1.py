"""Kolibri-1 (`Kolibri1ForCausalLM`: Aleph Alpha's Kolibri-1), as transformers computes it: EXAONE 4's attention
(per-head q/k RMSNorms before the rope; with a `sliding_window`, the rotary and the window in the layers
`layer_types` calls sliding, neither in the others: exaone4.global_nope) in GLM-4's sandwich layer
(`post_self_attn_layernorm` on the attention's output, `post_mlp_layernorm` on the MLP's, before each residual add),
every layer sparse: the router (a model-dtype weight, fp32 logits; held upcast) picks the top k of logits +
`e_score_correction_bias` (fp32) and weighs each by the sigmoid of its own logit, renormalised only with
`norm_topk_prob` (default off; no epsilon, no scale), plus an ungated shared SwiGLU of
`shared_expert_intermediate_size` (`mlp.shared_experts`).

Checkpoint names: `moe.router.expert_bias` -> `mlp.gate.e_score_correction_bias`, `post_attn_norm` /
`post_ffn_norm` -> `post_self_attn_layernorm` / `post_mlp_layernorm` (transformers' renames)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid
from .decoder import DecoderMLP, DecoderSpec
from .exaone_moe import ExaoneMoeForCausalLM
from .glm4 import Glm4Layer
from .glm4_moe import GroupedSigmoidRouter
from .moe import SparseMoeBlock

_RENAMES = ((".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
            (".post_attn_norm.", ".post_self_attn_layernorm."), (".post_ffn_norm.", ".post_mlp_layernorm."))


class Kolibri1MoeBlock(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts
    batch_invariant = False  # layers.set_batch_invariant: the weights' sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        # the router's weight held in fp32 (the model dtype's values upcast at load, exactly): transformers' fp32
        # product of the model-dtype weight, without an upcast copy per step
        self.gate = GroupedSigmoidRouter(facts["num_experts"], hf_config.hidden_size)
        width = int(hf_config.shared_expert_intermediate_size)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, E] fp32
        ids = torch.topk(logits + self.gate.e_score_correction_bias, self.top_k, dim=-1)[1]
        if forced is not None:  # routing replay: rows with ids >= 0 take them, weighted alike
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        weights = sigmoid(logits.gather(1, ids), self.batch_invariant)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] normed -> [T, H]
        return super().forward(x) + self.shared_experts.down(self.shared_experts.gate_up_proj(x))


class Kolibri1ForCausalLM(ExaoneMoeForCausalLM):
    """K-EXAONE's model (its attention, global NoPE, the shared experts' names) in GLM-4's sandwich layer with
    Kolibri-1's sparse block."""

    layer_class = Glm4Layer  # GLM-4's sandwich, its sparse blocks too
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".moe.router.expert_bias")

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Kolibri1MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().checkpoint_parts(name, tensor)
