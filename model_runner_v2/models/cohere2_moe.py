"""Cohere 2 MoE (`Cohere2MoeForCausalLM`: Cohere's Command A+), as transformers computes it: Cohere 2's parallel
layers (models/cohere.py: one norm read by attention and the MLP, interleaved fp32 rotary, a window in the sliding
layers, the logits times `logit_scale`, tied embeddings) with

- the norm an RMSNorm (Llama's) when the config names `rms_norm_eps`, else Cohere's LayerNorm (`layer_norm_eps`);
- the layers `mlp_layer_types` calls dense a SwiGLU of `prefix_dense_intermediate_size` (null: intermediate_size),
  the sparse ones `num_experts` SwiGLU experts of `intermediate_size`: the router takes the k largest logits (model
  dtype, no bias) and softmaxes them (`expert_selection_fn` "softmax": GPT-OSS's route_top_logits) or takes their
  sigmoids, divided by their sum when `norm_topk_prob` ("sigmoid"); plus `num_shared_experts` x intermediate_size of
  ungated shared expert, combined with the routed sum by `shared_expert_combination_strategy`: "sum" or "average"
  ((routed + shared) / 2);
- the rotary in the sliding layers and in the dense-prefix layers when `prefix_dense_sliding_window_pattern` is 1
  (transformers' force_rope), none in the other full layers.
Checkpoints name the experts per expert (`mlp.experts.E.{gate,up,down}_proj`, Qwen2-MoE's form) or stacked, the
shared expert `mlp.shared_experts.*`."""

from __future__ import annotations

import torch
from torch import nn

from ...config import moe_facts
from ...kernels.activation import sigmoid
from .cohere import Cohere2ForCausalLM, CohereLayer, CohereLayerNorm
from .decoder import DecoderSpec
from .layers import RMSNorm
from .moe import SparseMoeBlock, route_top_logits
from .qwen2_moe import Qwen2MoeForCausalLM
from .smollm3 import without_rotary
from .stablelm import ParallelMLP

_SELECTION = ("softmax", "sigmoid")
_COMBINATION = ("sum", "average")


def _choice(hf_config, key: str, default: str, allowed: tuple[str, ...]) -> str:
    value = getattr(hf_config, key, None) or default
    if value not in allowed:
        raise ValueError(f"config.json: {key}={value!r} is not supported (supported: {', '.join(allowed)})")
    return value


class Cohere2MoeBlock(SparseMoeBlock):
    batch_invariant = False  # layers.set_batch_invariant: the sigmoid router from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.sigmoid_router = _choice(hf_config, "expert_selection_fn", "softmax", _SELECTION) == "sigmoid"
        self.average = _choice(hf_config, "shared_expert_combination_strategy", "average", _COMBINATION) == "average"
        width = int(hf_config.intermediate_size) * int(getattr(hf_config, "num_shared_experts", 0) or 0)
        self.shared_experts = ParallelMLP(hf_config, spec, intermediate_size=width) if width else None

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # [T, E], the model dtype
        if not self.sigmoid_router:
            return route_top_logits(logits, self.top_k, forced)
        ids = logits.topk(self.top_k, dim=-1).indices
        if forced is not None:  # routing replay: rows with ids >= 0 take them
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        scores = sigmoid(logits.gather(-1, ids), self.batch_invariant)  # the model dtype, as transformers
        if self.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores.float(), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] normed -> [T, H]
        out = super().forward(x)
        if self.shared_experts is None:
            return out
        out = out + self.shared_experts(x)
        return out / 2 if self.average else out


class Cohere2MoeLayer(CohereLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        eps = getattr(hf_config, "rms_norm_eps", None)
        if eps is not None:
            return RMSNorm(hf_config.hidden_size, float(eps))
        return CohereLayerNorm(hf_config.hidden_size, float(getattr(hf_config, "layer_norm_eps", 1e-5)))


class Cohere2MoeForCausalLM(Cohere2ForCausalLM, Qwen2MoeForCausalLM):
    """Cohere 2's model and Qwen2-MoE's weight mapping (per-expert tensors, the shared expert's gate / up rows)."""

    layer_class = Cohere2MoeLayer

    def __init__(self, hf_config):
        super(Cohere2ForCausalLM, self).__init__(hf_config)  # Cohere's model; the rotary rule is this class's
        types = list(hf_config.layer_types)
        mlp_types = list(getattr(hf_config, "mlp_layer_types", None) or ["sparse"] * len(types))
        force = int(getattr(hf_config, "prefix_dense_sliding_window_pattern", 1) or 1) == 1
        without_rotary(layer for layer, kind, mlp in zip(self.model.layers, types, mlp_types)
                       if kind != "sliding_attention" and not (force and mlp == "dense"))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts(type(self).__name__, self.config)
        if layer_idx in facts["moe_layers"]:
            return Cohere2MoeBlock(self.config, layer_idx, facts, self.spec(self.config))
        width = getattr(self.config, "prefix_dense_intermediate_size", None) or self.config.intermediate_size
        return ParallelMLP(self.config, self.spec(self.config), intermediate_size=int(width))
