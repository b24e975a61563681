"""AFMoE (`AfmoeForCausalLM`: Arcee's Trinity Nano / Mini / Large), as transformers computes it:

    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))

with every norm (the four, the per-head q/k norms before the rope, the final one) in OLMo 2's order (the weight
times the fp32 row, then one cast). Attention: Llama's projections (biases on q, k, v, o with `attention_bias`),
the output gated per element by sigmoid(gate_proj(normed input)) before o_proj, a window and the rotary in the
layers `layer_types` calls sliding (three of every four by default), no rotary in the full ones. The first
`num_dense_layers` MLPs a SwiGLU of `intermediate_size`; the others `num_experts` SwiGLU experts of
`moe_intermediate_size` routed by sigmoid(router logits in the model dtype, then fp32): the k best of scores +
`expert_bias` (fp32), weighted by their scores renormalised (+ 1e-20) times `route_scale`, plus an ungated shared
expert of moe_intermediate_size x `num_shared_experts`. With `mup_enabled` the embeddings are times sqrt(hidden).

Checkpoint names: `self_attn.gate_proj` -> `self_attn.o_gate` (a dense MLP's gate_proj is gate_up_proj's part),
`mlp.router.gate` -> `mlp.gate`; the experts per expert or stacked (Qwen3-MoE's forms)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid
from .decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderSpec, norm_eps, sandwich_mlp
from .glm4_moe import weigh_chosen
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .parallel import ColumnParallelLinear
from .qwen2_moe import Qwen2MoeForCausalLM
from .smollm3 import rotary_in_sliding_layers_only

_RENAMES = ((".self_attn.gate_proj.", ".self_attn.o_gate."), (".mlp.router.gate.", ".mlp.gate."))


class AfmoeAttention(DecoderAttention):
    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        eps = norm_eps(hf_config)
        self.q_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)
        self.k_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)
        self.o_gate = ColumnParallelLinear(hf_config.hidden_size, [hf_config.num_attention_heads * self.head_dim])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: x is the embedding
            normed, residual = norm(x), x
        else:
            normed, residual = norm.add_and_norm(x, residual)
        q, k, v = self.qkv_proj(normed).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)  # [T, Hq * D]
        return self.o_proj(out * self.output_gate(normed)), residual

    def output_gate(self, normed: torch.Tensor) -> torch.Tensor:
        """[T, H] normed input -> the per-element gate [T, Hq * D] on the attention's output."""
        return sigmoid(self.o_gate(normed), self.batch_invariant)


class AfmoeLayer(DecoderLayer):
    attention_class = AfmoeAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.pre_mlp_layernorm = self.make_norm(hf_config)
        self.post_mlp_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), weight_in_fp32=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        return sandwich_mlp(self.mlp, attn, residual, self.pre_mlp_layernorm, self.post_attention_layernorm,
                            self.post_mlp_layernorm)


class AfmoeBlock(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts
    batch_invariant = False  # layers.set_batch_invariant: the scores' sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.route_scale = float(getattr(hf_config, "route_scale", 1.0))
        self.expert_bias = nn.Parameter(torch.empty(facts["num_experts"], dtype=torch.float32), requires_grad=False)
        width = facts["moe_intermediate_size"] * int(getattr(hf_config, "num_shared_experts", 0) or 0)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width) if width else None

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sigmoid(self.gate(x).float(), self.batch_invariant)  # [T, E]: logits rounded to the model dtype
        ids = torch.topk(scores + self.expert_bias, k=self.top_k, dim=-1, sorted=False)[1]
        return weigh_chosen(scores, ids, forced, renormalize=True, scale=self.route_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] normed -> [T, H]
        routed = super().forward(x)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts.down(self.shared_experts.gate_up_proj(x))


class AfmoeForCausalLM(Qwen2MoeForCausalLM):  # its shared experts named as GLM-4-MoE's
    layer_class = AfmoeLayer
    checkpoint_fp32_suffixes = (".mlp.expert_bias",)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_in_sliding_layers_only(self.model.layers, hf_config)
        if getattr(hf_config, "mup_enabled", False):
            self.model.embed_scale = float(hf_config.hidden_size**0.5)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return AfmoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super().checkpoint_parts(name, tensor)
