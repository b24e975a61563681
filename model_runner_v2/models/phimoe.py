"""Phi-3.5-MoE (`PhimoeForCausalLM`: Phi-3.5-MoE-instruct, Phi-tiny-MoE), as transformers' Phimoe computes it in
eval mode:

- Mixtral's layers (its attention with an optional window, its checkpoint names) with nn.LayerNorm (weight and bias)
  for every norm, q/k/v/o biases when `attention_bias`, an LM-head bias when `lm_head_bias`;
- longrope with the config's `short_mscale` / `long_mscale` as the cos/sin scale (RopeSettings);
- the SparseMixer router (`sparsemixer` without its training-time sampling), two experts per token: the first is
  the top logit, weighted by its softmax over the logits within a relative distance 2 * `router_jitter_noise` of
  that top one (the others masked); the second is the top logit with the first masked out, weighted by its softmax
  over the logits within that distance of *it*; the weights in the model dtype, not renormalised together.

Refused: num_experts_per_tok other than 2 (SparseMixer picks exactly two)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderSpec
from .layers import LayerNorm
from .mixtral import MixtralForCausalLM
from .moe import SparseMoeBlock


def _pick(scores: torch.Tensor, kept_from: torch.Tensor, eps: float, forced: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One SparseMixer pick: scores [T, E] (the model dtype), kept_from [T, E] (the logits competing for this pick:
    earlier picks at -inf) -> (weight [T, 1], id [T, 1]). The logits whose relative gap to the best competitor
    exceeds 2 * eps are masked; the pick is the best competitor (or `forced` where >= 0: routing replay), weighted
    by its softmax over the unmasked ones."""
    best, ids = kept_from.max(dim=-1, keepdim=True)
    if forced is not None:
        ids = torch.where(forced >= 0, forced.long(), ids)
    far = (best - scores) / scores.abs().clamp(min=best) > 2 * eps
    gates = torch.softmax(kept_from.masked_fill(far, float("-inf")), dim=-1)
    return gates.gather(-1, ids), ids


def route_sparsemixer(logits: torch.Tensor, eps: float, forced: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the model dtype) -> (weights [T, 2] in that dtype, ids [T, 2] int64): transformers'
    sparsemixer(training=False) op for op. forced [T, 2] int16: replayed ids where >= 0, weighted alike."""
    first_w, first = _pick(logits, logits, eps, None if forced is None else forced[:, :1])
    rest = torch.scatter(logits, -1, first, float("-inf"))
    second_w, second = _pick(logits, rest, eps, None if forced is None else forced[:, 1:])
    return torch.cat((first_w, second_w), dim=-1), torch.cat((first, second), dim=-1)


class SparseMixerMoeBlock(SparseMoeBlock):
    def __init__(self, hf_config, layer_idx: int, facts: dict):
        if facts["num_experts_per_tok"] != 2:
            raise ValueError(f"Phi-3.5-MoE with num_experts_per_tok={facts['num_experts_per_tok']} is not supported "
                             "(SparseMixer routes each token to exactly 2 experts)")
        super().__init__(hf_config, layer_idx, facts)
        self.eps = float(getattr(hf_config, "router_jitter_noise", 0.01))

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_sparsemixer(self.gate(x), self.eps, forced)


class PhimoeLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))  # nn.LayerNorm, the config's eps


class PhimoeForCausalLM(MixtralForCausalLM):
    layer_class = PhimoeLayer

    def __init__(self, hf_config):
        self.lm_head_bias = bool(getattr(hf_config, "lm_head_bias", False))
        super().__init__(hf_config)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return SparseMixerMoeBlock(self.config, layer_idx, facts)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # transformers' module names its router `mlp.router` (the checkpoints: block_sparse_moe.gate, Mixtral's)
        return super().checkpoint_parts(name.replace(".mlp.router.", ".mlp.gate."), tensor)
