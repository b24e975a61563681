"""Flint (`FlintForCausalLM`: Recursive's Flint MoE), as transformers computes it: Qwen3-MoE's model (per-head q/k
norms before the rope, sparse layers unless in `mlp_only_layers` / off `decoder_sparse_step`, a dense SwiGLU of
`intermediate_size` otherwise) with

- every RMSNorm (the layers', q/k's, the final one) in OLMo 2's order (the weight times the fp32 row, one cast);
- an attention sink per q head (`self_attn.sinks`, the hub's `softmax_offset`), kept in fp32 as transformers keeps it
  (Attention.enable_sinks: one more logit in every softmax's denominator);
- the rotary and a window of `sliding_window` in the layers `layer_types` calls sliding, neither in the full ones;
- the router in fp32 (weight and logits): the top k of sigmoid(logits), renormalised when `norm_topk_prob` (no
  epsilon, no bias, no scale); plus an ungated shared SwiGLU (`mlp.shared_expert`, `shared_expert_intermediate_size`
  wide) added to the routed sum.
In bf16 transformers scores the attention in fp32 (q and k upcast); the engine's eager path in the model dtype, its
kernels in fp32."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderSpec, norm_eps
from .glm4_moe import Fp32Router
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .parallel import get_tp_state, mark_sharded
from .qwen2_moe import Qwen2MoeForCausalLM
from .smollm3 import rotary_in_sliding_layers_only


class FlintAttention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        eps = norm_eps(hf_config)
        self.q_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)
        self.k_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)
        self.qk_norm = True
        self.attn.enable_sinks()
        self.attn.sinks = nn.Parameter(self.attn.sinks.detach().float(), requires_grad=False)  # fp32 (transformers')
        mark_sharded(self.attn.sinks, 0, get_tp_state(), hf_config.num_attention_heads)


class FlintLayer(DecoderLayer):
    attention_class = FlintAttention

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), weight_in_fp32=True)


class FlintMoeBlock(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.gate = Fp32Router(facts["num_experts"], hf_config.hidden_size)
        width = int(hf_config.shared_expert_intermediate_size)
        self.shared_expert = DecoderMLP(hf_config, spec, intermediate_size=width)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x))  # [T, E] fp32
        weights, ids = scores.topk(self.top_k, dim=-1)
        if forced is not None:  # routing replay: rows with ids >= 0 take them, weighted by their own scores
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
            weights = scores.gather(-1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] normed -> [T, H]
        return super().forward(x) + self.shared_expert.down(self.shared_expert.gate_up_proj(x))


class FlintForCausalLM(Qwen2MoeForCausalLM):  # its shared expert named as Qwen2-MoE's
    layer_class = FlintLayer
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".self_attn.sinks", ".self_attn.softmax_offset")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_in_sliding_layers_only(self.model.layers, hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return FlintMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for old in (".self_attn.sinks", ".self_attn.softmax_offset"):
            if name.endswith(old):
                name = name[: -len(old)] + ".self_attn.attn.sinks"
        return super().checkpoint_parts(name, tensor)
