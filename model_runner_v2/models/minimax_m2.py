"""MiniMax-M2 (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1, M2.5), as transformers' MiniMaxM2 computes it:

- Llama's pre-norm layers; attention without biases whose q and k RMSNorms span whole projections (Hq * D and
  Hkv * D wide, Llama's norm order: OLMoE's attention, olmo2.WholeQKNormAttention, all-reduced under tensor
  parallelism; config `qk_norm_type` "per_layer"), then rope on the first `rotary_dim` elements of each head
  (rotate-half pairs; the hub's config names `rotary_dim`, transformers' adds `partial_rotary_factor`);
- a sparse block in every layer: the router (`block_sparse_moe.gate`, no bias) in the model dtype, its logits
  upcast, scores = sigmoid(logits); the top k of scores + `e_score_correction_bias` (DeepSeek-V3's aux-loss-free
  balancing, a buffer in the model dtype as transformers keeps it) are chosen, each weighted by its unbiased score,
  renormalised to sum 1; Mixtral's experts (w1 gate, w3 up, w2 down; `intermediate_size` wide), no shared expert.

Checkpoints name the block as Mixtral's (`block_sparse_moe.*`, MixtralForCausalLM.checkpoint_parts). The hub's
multi-token-prediction modules (`model.layers.<num_hidden_layers + i>.*`, `num_mtp_modules`) are skipped, as vLLM
skips them. Refused (another model than transformers' class runs): lightning-attention layers (`attn_type_list`
0: MiniMax-Text-01's), a shared expert (`shared_intermediate_size`), q/k norms per head, a softmax router."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid
from .decoder import DecoderSpec, _head_dim
from .glm4_moe import weigh_chosen
from .mixtral import MixtralForCausalLM
from .moe import SparseMoeBlock
from .olmoe import OlmoeLayer


def route_biased_sigmoid(logits: torch.Tensor, correction: torch.Tensor | None, top_k: int,
                         forced: torch.Tensor | None = None, invariant: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (model dtype) -> (weights [T, k] fp32, ids [T, k] int64), transformers' MiniMaxM2TopKRouter:
    sigmoid of the fp32 logits; the k best of scores + correction [E] (None: no routing bias); each chosen expert
    weighted by its own score, renormalised. forced [T, k] int16 (routing replay): rows with ids >= 0 take them,
    weighted by their scores alike; invariant: batch-invariant mode's sigmoid (kernels/activation.py)."""
    scores = sigmoid(logits.float(), invariant)
    choice = scores if correction is None else scores + correction.float()
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    return weigh_chosen(scores, ids, forced, renormalize=True, scale=1.0)


class MiniMaxM2Block(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        self.e_score_correction_bias = None
        if getattr(hf_config, "use_routing_bias", True):  # transformers' buffer, in the model dtype
            self.e_score_correction_bias = nn.Parameter(torch.empty(facts["num_experts"]), requires_grad=False)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_biased_sigmoid(self.gate(x), self.e_score_correction_bias, self.top_k, forced,
                                    self.gate.batch_invariant)


def check_minimax_m2(hf_config) -> None:
    """ValueError naming each form of the config that transformers' MiniMaxM2 does not compute."""
    attn_types = getattr(hf_config, "attn_type_list", None) or ()
    problems = [what for what, bad in (
        ("lightning-attention layers (attn_type_list has 0: MiniMax-Text-01's form)", 0 in attn_types),
        ("a shared expert (shared_intermediate_size > 0)",
         (getattr(hf_config, "shared_intermediate_size", 0) or 0) > 0),
        (f"qk_norm_type {getattr(hf_config, 'qk_norm_type', None)!r} (only 'per_layer': one norm over all heads)",
         getattr(hf_config, "qk_norm_type", "per_layer") != "per_layer"),
        (f"scoring_func {getattr(hf_config, 'scoring_func', None)!r} (only 'sigmoid')",
         getattr(hf_config, "scoring_func", "sigmoid") != "sigmoid")) if bad]
    if problems:
        raise ValueError(f"this MiniMax-M2 config is not supported: {'; '.join(problems)}")


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    layer_class = OlmoeLayer  # pre-norm, whole-projection q/k norms in Llama's order

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        check_minimax_m2(hf_config)
        rotary_dim = getattr(hf_config, "rotary_dim", None)  # the hub's config: no partial_rotary_factor
        share = 1.0 if not rotary_dim else int(rotary_dim) / _head_dim(hf_config)
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                           partial_rotary_factor=share)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return MiniMaxM2Block(self.config, layer_idx, facts)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() \
                and int(parts[2]) >= self.config.num_hidden_layers:
            return ()  # a multi-token-prediction module
        return super().checkpoint_parts(name, tensor)
