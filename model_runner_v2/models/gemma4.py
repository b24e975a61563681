"""Gemma 4's text model (`Gemma4ForCausalLM`; the released `Gemma4ForConditionalGeneration` checkpoints — gemma-4-E2B,
E4B, 31B — served as their language model), as transformers computes it. The layer plan (which layers slide, each
layer's head dim and KV heads, which share an earlier layer's KV cache, the MLP widths) is gemma4_facts.py's.

Per layer, every op in the model dtype unless said, each norm an RMSNorm whose plain weight multiplies the fp32
row before one cast (`weight_in_fp32`; Gemma 3's (1 + w) is gone):
    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))        GeGLU (gelu_tanh), width per layer
    x = x + post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(x)) * ple[i]))   (PLE)
    x = x * layer_scalar                                                           a [1] tensor of the checkpoint
Attention: q and k normed per head before the rotation, v normed per head without a weight, the softmax scale 1;
sliding layers a window of `sliding_window` keys and the default rope over `head_dim`; full layers their own head
dim and the "proportional" rope (the whole head in the rotation, only its first quarter of pairs turning: the
others pass through); with `attention_k_eq_v` a full layer's V is its raw K projection (no v_proj). A KV-shared layer
(the last `num_kv_shared_layers`) projects and rotates q alone and attends over its producer's cache.
Model: the embeddings times sqrt(H) rounded to the dtype; the per-layer inputs (PLE, `hidden_size_per_layer_input`
P > 0): (norm(per_layer_model_projection(x) * H^-0.5) + embed_tokens_per_layer(ids) * sqrt(P)) * 2^-0.5, [T, L, P];
the final norm, the tied head, logits capped at `final_logit_softcapping`.

With `enable_moe_block` (gemma-4-26B-A4B) every layer also runs experts beside its dense MLP (Gemma4Moe: routed on
the residual stream, run on pre_feedforward_layernorm_2's output):
    m = post_feedforward_layernorm_1(mlp(...)) + post_feedforward_layernorm_2(experts(...))
Tensor parallelism splits each layer's heads (every layer's KV heads must divide: gemma4_facts), the MLPs and every
expert's width; the per-layer inputs' tables and projections and the router are whole on every rank. Piecewise CUDA
graphs are refused (gemma4_facts.resolve_gemma4_options): their buffers assume one head dim."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...config import moe_facts
from ...gemma4_facts import Gemma4LayerPlan, gemma4_layers, open_config
from ...kernels.activation import gelu_tanh
from ...model_config import layer_sliding_windows, position_limit
from ...rope_settings import RopeSettings
from ..attention import Attention
from ..forward_context import get_forward_context
from .decoder import DecoderLM, DecoderMLP, DecoderSpec
from .language_model import language_model_parts
from .layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from .llama4 import WeightlessRMSNorm
from .moe import SparseMoeBlock, StackedExperts
from .parallel import ColumnParallelLinear, RowParallelLinear, attach_lm_head, divide, embedding, get_tp_state
from .per_layer_shards import PerLayerShards

_SHARED_SKIPPED = ("k_proj", "v_proj", "k_norm", "v_norm")  # a KV-shared layer's (released E files keep them)


def _norm(dim: int, hf_config) -> RMSNorm:
    return RMSNorm(dim, float(hf_config.rms_norm_eps), weight_in_fp32=True)


def _dtype_scale(value: float) -> float:
    """`value` rounded to the model's dtype (the default one while the model is built), as HF's scale tensors."""
    return float(torch.tensor(value, dtype=torch.get_default_dtype(), device="cpu"))


class Gemma4Attention(nn.Module):
    def __init__(self, hf_config, plan: Gemma4LayerPlan, rotary: RotaryEmbedding):
        super().__init__()
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        self.plan, tp = plan, get_tp_state().size  # tensor parallelism: this rank's heads
        self.num_heads = divide(hf_config.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads, self.head_dim = divide(plan.kv_heads, tp, "a layer's KV heads"), plan.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_all, kv_all = self.q_size * tp, self.kv_size * tp
        parts = [q_all] + ([] if plan.shares_kv else [kv_all] * (1 if plan.k_eq_v else 2))
        self.qkv_proj = ColumnParallelLinear(hidden, parts, bias=bias)  # q | k | v rows (q alone when shared)
        self.o_proj = RowParallelLinear(q_all, hidden, bias=bias)
        self.q_norm = _norm(self.head_dim, hf_config)
        if not plan.shares_kv:
            self.k_norm = _norm(self.head_dim, hf_config)
            self.v_norm = WeightlessRMSNorm(self.head_dim, float(hf_config.rms_norm_eps))
        self.rotary = rotary
        self.attn = Attention(plan.kv_layer, self.num_heads, self.num_kv_heads, self.head_dim, 1.0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] (normed) -> [T, H]
        qkv = self.qkv_proj(x)
        if self.plan.shares_kv:
            q = qkv.view(-1, self.num_heads, self.head_dim)
            # q's norm and rotation (its first head stands in for a k: the producer's keys are cached already)
            q, _ = self.rotary(positions, q, q[:, :1], self.q_norm, self.q_norm)
            q = q.view(-1, self.num_heads, self.head_dim)
            ctx = get_forward_context()
            kv_cache, md = ctx.kv_caches[self.attn.layer_idx], ctx.attn_metadata
            if ctx.split is not None:  # piecewise graphs (refused for Gemma 4; kept for the hand-over's sake)
                return self.o_proj(ctx.split.attention(self.attn, q, kv_cache, md))
            out = self.attn.compute(q, kv_cache, md, ctx.attn_backend)
            return self.o_proj(out.reshape(-1, self.q_size))
        if self.plan.k_eq_v:
            q, k = qkv.split([self.q_size, self.kv_size], dim=-1)
            v = k  # the raw K projection, before k_norm and the rotation
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        v = self.v_norm(v.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm))


class Gemma4Router(nn.Module):
    """x [T, H] (the layer's residual stream, not normed) -> logits [T, E]: a weightless norm, times `scale` (the
    model dtype) and H^-0.5, then `proj`; `per_expert_scale` [E] weighs the chosen experts (Gemma4Moe)."""

    def __init__(self, hf_config, num_experts: int):
        super().__init__()
        hidden = hf_config.hidden_size
        self.norm = WeightlessRMSNorm(hidden, float(hf_config.rms_norm_eps))
        self.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.proj = Linear(hidden, num_experts)
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.scalar = hidden**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x) * self.scale * self.scalar)  # (x * scale) rounded, then the float's product


class Gemma4Moe(SparseMoeBlock):
    """The experts every Gemma 4 MoE layer runs beside its dense MLP: the softmax over all experts (fp32), the top
    k renormalised, times each chosen expert's per_expert_scale; GeGLU experts (`experts.gate_up_proj` [E, 2I, H],
    `down_proj` [E, H, I]) on the layer's pre_feedforward_layernorm_2 output."""

    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        nn.Module.__init__(self)
        self.layer_idx, self.top_k, self.norm_topk_prob = layer_idx, facts["num_experts_per_tok"], True
        self.router = Gemma4Router(hf_config, facts["num_experts"])
        # each rank its share of every expert's width
        self.experts = StackedExperts(facts["num_experts"], hf_config.hidden_size, facts["moe_intermediate_size"],
                                      gelu_tanh=True, fp32_weights=self.fp32_weights)
        self.tp_size = get_tp_state().size  # > 1: the experts' partial sums all-reduced (SparseMoeBlock.reduce)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        ids = probs.topk(self.top_k, dim=-1).indices
        if forced is not None:  # routing replay: the rows' own ids, weighted alike
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        weights = probs.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True) * self.router.per_expert_scale[ids], ids

    def forward(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # routed on residual, run on x
        weights, ids = self.record_routes(residual)
        return self.reduce(self.experts(x, ids, weights))


class Gemma4Layer(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the PLE gate's GELU from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, plan: Gemma4LayerPlan, rotary: RotaryEmbedding, moe: Gemma4Moe | None):
        super().__init__()
        hidden = hf_config.hidden_size
        self.self_attn = Gemma4Attention(hf_config, plan, rotary)
        self.moe = moe  # the checkpoint's `router.*` and `experts.*` of the layer
        if moe is not None:
            for name in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"):
                setattr(self, name, _norm(hidden, hf_config))
        self.mlp = DecoderMLP(hf_config, Gemma4ForCausalLM.spec(hf_config), intermediate_size=plan.mlp_width,
                              act=getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, _norm(hidden, hf_config))
        per_layer = int(getattr(hf_config, "hidden_size_per_layer_input", 0) or 0)
        self.per_layer_input_gate = Linear(hidden, per_layer) if per_layer else None
        self.per_layer_projection = Linear(per_layer, hidden) if per_layer else None
        self.post_per_layer_input_norm = _norm(hidden, hf_config) if per_layer else None
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)  # the checkpoint's buffer

    def forward(self, positions: torch.Tensor, x: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        """x [T, H] (the residual stream itself: layer_scalar scales all of it), per_layer [T, P] or None."""
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x)))
        m = self.mlp.down(self.mlp.gate_up_proj(self.pre_feedforward_layernorm(x)))
        if self.moe is not None:
            experts = self.moe(x, self.pre_feedforward_layernorm_2(x))
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(experts)
        x = x + self.post_feedforward_layernorm(m)
        if per_layer is not None:
            g = gelu_tanh(self.per_layer_input_gate(x), self.batch_invariant) * per_layer
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, hf_config, plans: tuple[Gemma4LayerPlan, ...]):
        super().__init__()
        c, hidden = hf_config, hf_config.hidden_size
        self.embed_tokens = embedding(c.vocab_size, hidden)  # vocab-parallel under TP (the tied head's rows)
        positions = position_limit(c)
        rotary = {}
        for kind in ("sliding_attention", "full_attention"):
            dims = {p.head_dim for p in plans if p.kind == kind}
            if len(dims) > 1:
                raise ValueError(f"Gemma 4's {kind} layers must share one head dim, got {sorted(dims)}")
            if dims:
                settings = RopeSettings.from_hf_config(c, layer_type=kind)
                rotary[kind] = RotaryEmbedding(dims.pop(), settings.max_positions(positions), settings)
        self.rotary = nn.ModuleDict(rotary)
        self.layers = nn.ModuleList(self.make_layer(c, plan, rotary[plan.kind], i) for i, plan in enumerate(plans))
        self.norm = _norm(hidden, c)
        self.embed_scale = _dtype_scale(hidden**0.5)
        self.per_layer = int(getattr(c, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer:
            width = len(plans) * self.per_layer
            self.embed_tokens_per_layer = Embedding(int(c.vocab_size_per_layer_input), width)
            self.per_layer_model_projection = Linear(hidden, width)
            self.per_layer_projection_norm = _norm(self.per_layer, c)
            self.per_layer_scale = _dtype_scale(self.per_layer**0.5)
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    @staticmethod
    def make_layer(hf_config, plan: Gemma4LayerPlan, rotary: RotaryEmbedding, i: int) -> nn.Module:
        facts = moe_facts("Gemma4ForCausalLM", hf_config)  # {} unless enable_moe_block
        return Gemma4Layer(hf_config, plan, rotary, Gemma4Moe(hf_config, i, facts) if facts else None)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: each layer's input from the token's own table row and a projection of its embedding x."""
        shape = (x.shape[0], len(self.layers), self.per_layer)
        token = (self.embed_tokens_per_layer(input_ids) * self.per_layer_scale).reshape(shape)
        proj = self.per_layer_model_projection(x) * self.embed_tokens.weight.shape[1] ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, self.per_layer)).reshape(shape)  # each layer's P
        return (proj + token) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale  # [T, H]
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i])
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, torch.zeros_like(x))  # [T, H] fp32
        return self.norm(x)


class Gemma4ForCausalLM(PerLayerShards, DecoderLM):  # q / k / v and gate / up rows differ by layer
    model_class: type[nn.Module] = Gemma4Model  # Gemma 3n: its own (gemma3n.py)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    @classmethod
    def layer_plans(cls, hf_config) -> tuple[Gemma4LayerPlan, ...]:
        return gemma4_layers(hf_config)

    def __init__(self, hf_config):
        nn.Module.__init__(self)
        c = open_config(hf_config)
        plans = self.layer_plans(c)
        self.config, self.plans = c, plans
        self.model = self.model_class(c, plans)
        attach_lm_head(self, c, tie_default=True)
        windows = layer_sliding_windows(type(self).__name__, c)
        for layer, plan in zip(self.model.layers, plans):
            layer.self_attn.attn.set_window(windows[plan.kv_layer])
        self.final_logit_softcapping = float(getattr(c, "final_logit_softcapping", None) or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits  # transformers' three ops, in the logits' dtype

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] in ("router", "experts"):
            return ((".".join(parts[:3] + ["moe"] + parts[3:]), tensor),)  # the MoE block's own
        if (len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in _SHARED_SKIPPED and self.plans[int(parts[2])].shares_kv):
            return ()  # a KV-shared layer computes no K/V (transformers ignores these too)
        return ((name, tensor),)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The released checkpoints: `model.language_model.*` served as Gemma4ForCausalLM's `model.*`; the vision and
    audio towers and their embedders skipped (language_model.py)."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for text_name, text_tensor in language_model_parts(name, tensor):
            yield from super().checkpoint_parts(text_name, text_tensor)
