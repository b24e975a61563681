"""Beam (`BeamForCausalLM`: Reflection's Beam-1.0-501B-A23B), as transformers computes it. Plain grouped-query
attention (its DeepSeek-named parents give it no MLA, indexer or multi-token prediction), per-head q/k norms and
every other norm in OLMo 2's order (the weight times the fp32 row, one cast), and a depth-scaled sandwich residual:
layer i's attention (k = 2(i + 1)) and MLP (k + 1) each join the stream as

    h = norm_post(block(norm_pre(h))) * (1 / sqrt(k)) + h * sqrt((k - 1) / k)      (each product rounded, then the sum)

Attention: the output gated per element by sigmoid(gate_proj(normed input) + gate_bias[head]) before o_proj; the
layers `layer_types` calls sliding rotate (the neox pairs over the whole head, the rotation in fp32 from fp32 tables)
with rope_parameters["sliding_attention"] inside their window; the full layers rotate nothing (their entry is None)
and scale the normed q by exp(0.1 * log1p((position + 1) / 2048)) (transformers' "scalable softmax"; the cache holds
the unscaled K). MLPs: dense SwiGLU (`mlp_layer_types`), the activation times up in fp32 with one rounding; or
`num_experts` experts routed as DeepSeek-V3 (fp32 router, sigmoid scores + e_score_correction_bias, the
`topk_group` best of `n_group` groups, renormalised), no shared expert, the routed sum times routed_scaling_factor
in the model dtype. The logits capped in fp32 at final_logit_softcapping.

bf16 difference from transformers (within its own bf16 noise): the experts' SwiGLU rounds twice (the fused experts
kernel's silu, then its product; transformers' once); their copies are weighed and summed in fp32 as transformers'.
Checkpoint names: `self_attn.gate_proj` -> `self_attn.o_gate` (a dense MLP's gate_proj is gate_up_proj's part)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import sigmoid
from .afmoe import AfmoeAttention
from .decoder import DecoderLayer, DecoderMLP, DecoderSpec, norm_eps, rotary_per_layer_type
from .glm4_moe import GroupedSigmoidRouter, check_groups, route_grouped_sigmoid
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .parallel import get_tp_state, mark_sharded
from .qwen3_moe import Qwen3MoeForCausalLM
from .smollm3 import identity_rotary


class SiluMulFp32(nn.Module):
    """[..., 2I] (gate | up) -> silu(gate) * up in fp32, rounded once to x's dtype (Beam's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(x.dtype)


class ScalableSoftmaxQuery(nn.Module):
    """The rotary callable of Beam's full layers: no rotation (the identity rotary: the q/k norms, the KV write),
    then q [T, Hq * D] times exp(0.1 * log1p((position + 1) / 2048)) in fp32, rounded once."""

    def __init__(self, identity: RotaryEmbedding):
        super().__init__()
        self.identity = identity

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None, kv_write=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k = self.identity(positions, q, k, q_norm, k_norm, kv_write)
        factor = torch.exp(0.1 * torch.log1p((positions.float() + 1.0) / 2048.0))  # [T]
        return (q.float() * factor[:, None]).to(q.dtype), k


class BeamAttention(AfmoeAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.gate_bias = nn.Parameter(torch.empty(self.q_size // self.head_dim), requires_grad=False)  # [Hq local]
        mark_sharded(self.gate_bias, 0, get_tp_state(), hf_config.num_attention_heads)

    def output_gate(self, normed: torch.Tensor) -> torch.Tensor:
        """AFMoE's gate with a bias per head: sigmoid(o_gate(normed) + gate_bias[head]) [T, Hq * D]."""
        gate = self.o_gate(normed).view(-1, self.gate_bias.shape[0], self.head_dim) + self.gate_bias[:, None]
        return sigmoid(gate, self.batch_invariant).flatten(1)


class BeamLayer(DecoderLayer):
    attention_class = BeamAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.pre_feedforward_layernorm = self.make_norm(hf_config)
        self.post_feedforward_layernorm = self.make_norm(hf_config)
        k = 2 * (layer_idx + 1)  # the attention's depth; the MLP's is k + 1
        self.attn_scales = (1.0 / math.sqrt(k), math.sqrt((k - 1) / k))  # (the block's, the stream's)
        self.mlp_scales = (1.0 / math.sqrt(k + 1), math.sqrt(k / (k + 1)))

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), weight_in_fp32=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the (block, stream) pair pre-scaled: the next norm's add (the next layer's, or the final one) is
        transformers' sum of the two rounded products."""
        attn, h = self.self_attn(positions, x, residual, self.input_layernorm)
        block, keep = self.attn_scales
        normed, h = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn) * block, h * keep)
        mlp = self.mlp.down(self.mlp.gate_up_proj(normed)) if isinstance(self.mlp, DecoderMLP) else self.mlp(normed)
        block, keep = self.mlp_scales
        return self.post_feedforward_layernorm(mlp) * block, h * keep


class BeamMoeBlock(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        self.gate = GroupedSigmoidRouter(facts["num_experts"], hf_config.hidden_size)
        self.n_group, self.topk_group = int(hf_config.n_group), int(hf_config.topk_group)
        check_groups(facts["num_experts"], self.n_group, self.topk_group)
        self.scale = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_grouped_sigmoid(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, 1.0, forced, self.gate.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]: the scale after the sum, model dtype
        return super().forward(x) * self.scale


class BeamForCausalLM(Qwen3MoeForCausalLM):
    layer_class = BeamLayer
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, rope_fp32=True, rope_fp32_tables=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        full = [layer for layer, kind in zip(self.model.layers, hf_config.layer_types) if params.get(kind) is None]
        if full:  # the layers whose kind has no rope: NoPE with the scaled q
            scaled = ScalableSoftmaxQuery(identity_rotary(full[0].self_attn.rotary))
            for layer in full:
                layer.self_attn.rotary = scaled
        self.final_logit_softcapping = float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        mlp = super().build_mlp(layer_idx)
        if isinstance(mlp, DecoderMLP):
            mlp.act = SiluMulFp32()  # not SiluAndMul: down() then skips the GEMV's two-rounding form
        return mlp

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return BeamMoeBlock(self.config, layer_idx, facts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits.float() / cap) * cap if cap else logits  # fp32, as transformers

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().checkpoint_parts(name.replace(".self_attn.gate_proj.", ".self_attn.o_gate."), tensor)
