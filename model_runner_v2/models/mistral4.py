"""Mistral 4 (`Mistral4ForCausalLM`; Mistral Small 4's `Mistral3ForConditionalGeneration` checkpoints, whose
`text_config` is a "mistral4" model: served as that language model, model_config.from_pretrained), as transformers
computes it: DeepSeek-V3's layers (multi-head latent attention with a q LoRA, dense layers below
`first_k_dense_replace`, routed experts plus a shared one) with
- Llama 4's query temperature past the YaRN pretraining context (mistral3.QueryTemperature; transformers multiplies
  after the rotation, the engine before it: the same product up to one rounding in bf16);
- its own router, in the model dtype (transformers keeps no fp32 copy): scores = softmax(logits) over all experts,
  a group's score the sum of its two best, the `topk_group` best of `n_group` groups kept, the top k of their scores,
  each weighted by its score, renormalised (+ 1e-20) when `norm_topk_prob`, times `routed_scaling_factor`.
No correction bias, no MTP layer."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .deepseek import DeepseekV3ForCausalLM, MlaDecoderLayer
from .glm4_moe import SharedExpertsBlock, check_groups, in_top_groups, weigh_chosen
from .language_model import language_model_parts
from .mistral3 import query_temperature
from .mla import MlaAttention


def route_softmax_top2_groups(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                              scale: float, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (model dtype) -> (weights [T, k] fp32, ids [T, k] int64), transformers' Mistral4TopkRouter op
    for op in the logits' dtype. forced [T, k] int16 (routing replay): rows with ids >= 0 take them, weighted by
    their own scores alike."""
    scores = logits.softmax(-1)
    num_experts = scores.shape[-1]
    group_scores = scores.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
    choice = scores.masked_fill(~in_top_groups(group_scores, topk_group, num_experts), 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights, ids = weigh_chosen(scores, ids, forced, renormalize, scale)
    return weights.float(), ids


class Mistral4MoeBlock(SharedExpertsBlock):
    """The routed experts and the shared one; `gate` a plain linear in the model dtype (SparseMoeBlock's)."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec):
        super().__init__(hf_config, layer_idx, facts, spec)
        self.n_group, self.topk_group = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
        check_groups(facts["num_experts"], self.n_group, self.topk_group)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_softmax_top2_groups(self.gate(x), self.top_k, self.n_group, self.topk_group,
                                         self.norm_topk_prob, self.scale, forced)


class Mistral4Attention(MlaAttention):
    def __init__(self, hf_config, spec, layer_idx: int, rotary):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.temperature = query_temperature(hf_config)

    def scale_query(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return self.temperature(positions, q)


class Mistral4Layer(MlaDecoderLayer):
    attention_class = Mistral4Attention


class Mistral4ForCausalLM(DeepseekV3ForCausalLM):
    layer_class = Mistral4Layer
    checkpoint_fp32_suffixes = ()  # the router in the model dtype, as transformers keeps it

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Mistral4MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Mistral Small 4's multimodal files: the language model's tensors renamed, the vision tower's skipped."""
        for part in language_model_parts(name, tensor):
            yield from super().checkpoint_parts(*part)
