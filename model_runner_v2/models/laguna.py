"""Laguna (`LagunaForCausalLM`: Poolside's Laguna MoE), as transformers' Laguna computes it: Llama's pre-norm layers
(`layer_types`: full and sliding layers, each kind its own rope from rope_parameters, partial factors included) with

- an attention of `num_attention_heads_per_layer[i]` q heads (the KV heads and head dim the same in every layer: one
  KV cache shape), Qwen3's per-head q/k norms before the rope, biases on q/k/v/o when `attention_bias`, and an output
  gate softplus(g_proj(x)) (fp32, rounded) per head (`gating` true / "per-head") or per element ("per-element")
  on the attention's output before o_proj;
- `mlp_layer_types`' dense layers a SwiGLU; its sparse ones a router of model-dtype logits (softcapped at
  `moe_router_logit_softcapping` when > 0, in fp32), sigmoid scores, the top k of scores + `e_score_correction_bias`,
  renormalised and rounded to the model dtype; the experts' sum times `moe_routed_scaling_factor` (in the model dtype,
  after the sum), plus an ungated shared expert of `shared_expert_intermediate_size`.

The files name the correction `mlp.experts.e_score_correction_bias` and the shared expert `mlp.shared_expert.*`
(transformers' modules: `mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`). Piecewise CUDA graphs are refused
(their buffers assume one q width: gemma4_facts.resolve_gemma4_options)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid, softplus
from ..attention import Attention
from .decoder import DecoderLayer, DecoderMLP, DecoderSpec, rotary_per_layer_type
from .layers import Linear, RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state
from .per_layer_shards import PerLayerShards
from .qwen2_moe import Qwen2MoeForCausalLM


def q_heads(hf_config, layer_idx: int) -> int:
    per_layer = getattr(hf_config, "num_attention_heads_per_layer", None)
    return int(per_layer[layer_idx] if per_layer else hf_config.num_attention_heads)


class LagunaAttention(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the gate's softplus from torch.exp / log (kernels/activation)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden, tp = hf_config.hidden_size, get_tp_state().size
        heads, kv_heads = q_heads(hf_config, layer_idx), int(hf_config.num_key_value_heads)
        self.head_dim = int(getattr(hf_config, "head_dim", None) or hidden // int(hf_config.num_attention_heads))
        self.num_heads = divide(heads, tp, "a layer's q heads")
        self.num_kv_heads = divide(kv_heads, tp, "num_key_value_heads")
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.qkv_proj = ColumnParallelLinear(hidden, parts, bias=spec.qkv_bias)  # q | k | v rows (local)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=spec.o_bias)
        gating = getattr(hf_config, "gating", True)
        self.per_head = gating is True or gating == "per-head"
        self.g_proj = ColumnParallelLinear(hidden, [heads if self.per_head else heads * self.head_dim])
        eps = float(hf_config.rms_norm_eps)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.rotary = rotary  # the full layers' (rotary_per_layer_type gives the sliding ones theirs)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)  # [T, Hq * D]
        gate = softplus(self.g_proj(x).float(), self.batch_invariant).to(out.dtype)  # [T, Hq] or [T, Hq * D]
        if self.per_head:
            out = (out.view(-1, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).view(-1, self.q_size)
        else:
            out = out * gate
        return self.o_proj(out), residual


class LagunaLayer(DecoderLayer):
    attention_class = LagunaAttention


class LagunaRouter(Linear):
    """`mlp.gate`: the router's weight and its correction, both in the model dtype."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(hidden, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class LagunaMoeBlock(SparseMoeBlock):
    batch_invariant = False  # layers.set_batch_invariant: the sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.gate = LagunaRouter(hf_config.hidden_size, facts["num_experts"])
        self.softcap = float(getattr(hf_config, "moe_router_logit_softcapping", 0.0) or 0.0)
        self.scale = float(getattr(hf_config, "moe_routed_scaling_factor", 1.0) or 1.0)
        width = int(hf_config.shared_expert_intermediate_size)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width)
        if getattr(hf_config, "moe_apply_router_weight_on_input", False):
            raise ValueError("moe_apply_router_weight_on_input=True is not supported (transformers refuses it too)")

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        if self.softcap > 0.0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = sigmoid(logits, self.batch_invariant)
        ids = torch.topk(scores + self.gate.e_score_correction_bias.float(), self.top_k, dim=-1)[1]
        if forced is not None:  # routing replay: the rows' own ids, weighted alike
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        weights = scores.gather(-1, ids)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float(), ids  # rounded as transformers

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        shared = self.shared_experts.down(self.shared_experts.gate_up_proj(x))
        return super().forward(x) * self.scale + shared


class LagunaForCausalLM(PerLayerShards, Qwen2MoeForCausalLM):  # q rows differ by layer
    layer_class = LagunaLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return LagunaMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = name.replace(".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super().checkpoint_parts(name.replace(".mlp.shared_expert.", ".mlp.shared_experts."), tensor)
