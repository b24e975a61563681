"""Ling 3 (`BailingHybridForCausalLM`: inclusionAI's Ling-3.0-Flash), as transformers' BailingHybrid computes it:
Kimi Linear's hybrid (kimi_linear.py: Kimi Delta Attention layers beside DeepSeek-V3's latent attention, pre-norm
layers, DeepSeek-V3's MLP) with these differences:

- the layers' kinds: every `layer_group_size`-th layer full attention, the others KDA (transformers derives
  `layer_types` so);
- KDA's forget gate one projection: u = f_proj(x) + dt_bias [T, H, D] fp32, a = exp(A_log[h]) and
  g = kda_lower_bound * sigmoid(a * u) (`kda_safe_gate`, the default) or -a * softplus(u), rounded to the model
  dtype (transformers'); its output gate one projection too: o_norm(o, g_proj(x)), sigmoid-gated as Kimi's;
- the latent attention keeps its rotary (interleaved pairs over qk_rope_head_dim, `rope_parameters`) and gates each
  head's output: o_proj(out * sigmoid(g_proj(x))) (g_proj [H, hidden]; the sigmoid in fp32, rounded, the product in
  the model dtype);
- the sparse layers' experts (and shared experts) clip their SwiGLU where the layer's `expert_swiglu_limit_list`
  (`share_expert_swiglu_limit_list`) entry is not 0: min(silu(gate), limit) * clamp(up, -limit, limit)
  (kernels/activation.ClippedSwiGLU; the dense layers' MLPs never clip).

Its checkpoints keep Bailing's names (transformers' conversion mapping): `model.word_embeddings`, `attention.*`
for `self_attn.*`, `attention.dense` for o_proj, the forget gate's `f_proj` / `dt_bias` / `A_log` directly under the
attention, the convolution as `{q,k,v}_conv1d`, experts per expert, `mlp.gate.expert_bias` for the router's
correction; the multi-token-prediction layers (`model.layers.<num_hidden_layers + i>`) are skipped. dt_bias and
A_log stay fp32, as transformers keeps them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from ...kernels.activation import ClippedSwiGLU, clipped_swiglu_torch, sigmoid, softplus
from .decoder import DecoderSpec
from .glm4_moe import Glm4MoeBlock
from .kimi_linear import KimiDeltaAttention, KimiLinearForCausalLM, KimiLinearLayer
from .layers import RotaryEmbedding
from .mla import MlaAttention
from .moe import StackedExperts
from .parallel import ColumnParallelLinear, get_tp_state, mark_sharded

# the hub's names -> transformers' (and the engine's), in this order
_HUB_RENAMES = ((".attention.", ".self_attn."), (".self_attn.dense.", ".self_attn.o_proj."),
                (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))


def check_config(hf_config) -> None:
    """What the engine builds of a BailingHybrid config; ValueError for the rest."""
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":  # the convolution's activation, the experts' and the MLPs'
        raise ValueError(f"BailingHybrid: hidden_act {act!r} is not supported (only 'silu')")
    kinds = list(getattr(hf_config, "mlp_layer_types", None) or [])
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - {"dense", "sparse"}:
        raise ValueError(f"BailingHybrid: mlp_layer_types {kinds} must name {hf_config.num_hidden_layers} layers, "
                         "each 'dense' or 'sparse'")
    for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        limits = getattr(hf_config, name, None)
        if limits is not None and len(limits) != hf_config.num_hidden_layers:
            raise ValueError(f"BailingHybrid: {name} must give one limit per decoder layer, got {list(limits)}")


def _limit(hf_config, name: str, layer_idx: int) -> float | None:
    """The layer's SwiGLU clipping limit from a per-layer list; None where it is 0 or the config has none."""
    limits = getattr(hf_config, name, None)
    return float(limits[layer_idx]) if limits and limits[layer_idx] else None


class ClippedSiluAndMul(nn.Module):
    """[..., 2I] (gate | up) -> min(silu(gate), limit) * clamp(up, -limit, limit) [..., I]: a shared expert's
    clipped activation (its DecoderMLP's `act`). `batch_invariant`: the SiLU in its row-invariant form."""

    batch_invariant = False

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clipped_swiglu_torch(x, self.limit, self.batch_invariant)


class ClippedExperts(StackedExperts):
    """StackedExperts whose SwiGLU clips (ClippedSwiGLU): on CUDA inside the fused kernel, elsewhere in torch."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__(num_experts, hidden_size, intermediate_size, fp32_weights=True)
        self.clamped = ClippedSwiGLU(limit)  # fused_experts_triton's `act`

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clipped_swiglu_torch(gate_up, self.clamped.limit, self.batch_invariant)


class BailingMoeBlock(Glm4MoeBlock):
    """DeepSeek-V3's sparse block (Glm4MoeBlock: the grouped sigmoid router, shared experts) with the layer's clipping
    limits on its routed and shared experts' SwiGLU."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        limit = _limit(hf_config, "expert_swiglu_limit_list", layer_idx)
        if limit is not None:
            self.experts = ClippedExperts(facts["num_experts"], hf_config.hidden_size, facts["moe_intermediate_size"],
                                          limit)
        shared = _limit(hf_config, "share_expert_swiglu_limit_list", layer_idx)
        if shared is not None and self.shared_experts is not None:
            self.shared_experts.act = ClippedSiluAndMul(shared)  # (DecoderMLP.down: no fused SiLU GEMV then)


class BailingForgetGate(nn.Module):
    """KDA's forget gate of Ling 3 (`self_attn.forget_gate`): f_proj [H * D, hidden] (this rank's heads), dt_bias
    [H * D] and A_log [H], both fp32."""

    def __init__(self, hf_config, num_heads: int, head_dim: int):
        super().__init__()
        tp, total = get_tp_state(), int(hf_config.linear_num_heads)
        width = num_heads * head_dim
        self.f_proj = ColumnParallelLinear(hf_config.hidden_size, [total * head_dim])
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
        self.safe = bool(getattr(hf_config, "kda_safe_gate", True))
        self.lower_bound = float(getattr(hf_config, "kda_lower_bound", -5.0))
        if tp.size > 1:
            mark_sharded(self.dt_bias, 0, tp, total * head_dim)
            mark_sharded(self.A_log, 0, tp, total)


class BailingDeltaAttention(KimiDeltaAttention):
    """Kimi Delta Attention with Ling 3's one-projection forget and output gates (the module docstring)."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        del self.g_a_proj, self.g_b_proj
        self.forget_gate = BailingForgetGate(hf_config, self.num_heads, self.head_dim)
        self.g_proj = ColumnParallelLinear(hf_config.hidden_size, [int(hf_config.linear_num_heads) * self.head_dim])

    def decay(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H, D] fp32
        gate = self.forget_gate
        u = (gate.f_proj(x).float() + gate.dt_bias).view(-1, self.num_heads, self.head_dim)
        rate = gate.A_log.exp()[:, None]  # [H, 1]
        if gate.safe:
            g = gate.lower_bound * sigmoid(rate * u, self.batch_invariant)
        else:
            g = -rate * softplus(u, True)
        return g.to(x.dtype).float()  # transformers hands the decay over in the model dtype

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H * D]
        return self.g_proj(x)


class BailingAttention(MlaAttention):
    """MLA with a head-wise output gate: g_proj [H, hidden] (split with the heads under tensor parallelism)."""

    batch_invariant = False  # set_batch_invariant: the gate's sigmoid in its row-invariant form

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.g_proj = ColumnParallelLinear(hf_config.hidden_size, [hf_config.num_attention_heads])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        out = self.attend(positions, x, self.scale_query(positions, self.query(x)))  # [T, H * v]
        gate = sigmoid(self.g_proj(x).float(), self.batch_invariant).to(out.dtype)  # [T, H]
        out = out.view(x.shape[0], self.num_heads, self.v_head_dim) * gate[..., None]
        return self.o_proj(out.reshape(x.shape[0], -1)), residual


class BailingHybridLayer(KimiLinearLayer):
    linear_class = BailingDeltaAttention
    full_class = BailingAttention


class BailingHybridForCausalLM(KimiLinearForCausalLM):
    layer_class = BailingHybridLayer
    checkpoint_fp32_suffixes = (*KimiLinearForCausalLM.checkpoint_fp32_suffixes, ".forget_gate.A_log")
    forget_gate_parts = ("f_proj", "dt_bias", "A_log")
    nope_mla = False

    def __init__(self, hf_config):
        check_config(hf_config)
        super().__init__(hf_config)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return replace(super().spec(hf_config), rope_interleaved=True)  # its config has no rope_interleave

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return BailingMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The hub's names as transformers' (the module docstring); the MTP layers skipped before Kimi Linear's
        per-layer renames look their layer up."""
        if name.startswith("model.word_embeddings."):
            name = "model.embed_tokens." + name[len("model.word_embeddings."):]
        for hub, ours in _HUB_RENAMES:
            name = name.replace(hub, ours)
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit() and int(
                parts[2]) >= self.config.num_hidden_layers:
            return ()
        return super().checkpoint_parts(name, tensor)
