"""Llama 4 (`Llama4ForCausalLM`; `Llama4ForConditionalGeneration`: Llama 4 Scout / Maverick, served as their language
model), as transformers' Llama4TextModel computes it:

- Llama's pre-norm layers; in the layers `no_rope_layers` marks 1 the rope rotates each head in interleaved pairs
  (the complex product of transformers, in fp32 over fp32 tables, one rounding), then, with `use_qk_norm`, each q
  and k head is L2-normed (an RMSNorm without weight, in fp32: `RopeThenL2Norm`); those layers attend in chunks of
  `attention_chunk_size` (a query at p sees the keys p // chunk * chunk .. p: Attention.set_chunk), where the
  config's `layer_types` say "chunked_attention";
- the other layers ("NoPE") rotate nothing, attend to the whole context, and scale each query by
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 when `attn_temperature_tuning` (`NoPETemperature`: 1 below
  position floor_scale - 1, where nothing is computed);
- a sparse block in the layers `moe_layers` names (every `interleave_moe_layer_step`-th), else a dense SwiGLU of
  `intermediate_size_mlp`: the router (`feed_forward.router`, no bias) in the model dtype picks the top-1 logit,
  the token is scaled by sigmoid(that logit) (fp32, rounded to the model dtype) *before* its expert, whose output
  is taken unweighted, plus a shared expert (`feed_forward.shared_expert`) on the unscaled token.

Checkpoints name the MLP `feed_forward` and store the experts stacked and transposed (`experts.gate_up_proj`
[E, H, 2I]: gate | up along the last dim; `experts.down_proj` [E, I, H]): renamed and transposed at load. The
multimodal checkpoints' vision model and projector are skipped. Refused: num_experts_per_tok > 1 (transformers'
form scales the input per expert: no released model uses it)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...config import moe_facts
from .decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderSpec
from .language_model import language_model_parts
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .qwen2_moe import Qwen2MoeForCausalLM
from .rope_then_norm import RopeThenNorm
from .smollm3 import identity_rotary


class WeightlessRMSNorm(RMSNorm):
    """x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype (transformers' Llama4TextL2Norm): Llama's RMSNorm
    with a weight of ones (times one in the model dtype changes no bit), held as a buffer: no checkpoint tensor."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        del self.weight
        self.register_buffer("weight", torch.ones(dim), persistent=False)


class RopeThenL2Norm(RopeThenNorm):
    """The rotary callable of Llama 4's rope layers with `use_qk_norm`: the rope, then each q and k head L2-normed
    (its own weightless norm: the attention has none)."""

    def __init__(self, rope: RotaryEmbedding, identity: RotaryEmbedding, eps: float):
        super().__init__(rope, identity)
        self.norm = WeightlessRMSNorm(rope.head_dim, eps)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None, kv_write=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, Hq, D], k [T, Hkv, D] -> (q [T, Hq*D], k [T, Hkv*D] or None after a fused KV write)."""
        if q_norm is not None or k_norm is not None:
            raise ValueError("Llama 4's rope layers norm after the rotation, not before it")
        return super().forward(positions, q, k, self.norm, self.norm, kv_write)


class NoPETemperature(nn.Module):
    """positions [T], q [T, Hq * D] -> q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1), the product in
    fp32 rounded once to q's dtype (transformers' Llama4TextAttention in its NoPE layers). The factor is exactly 1
    below position floor_scale - 1: an engine whose sequences stay there computes nothing (fit_context)."""

    def __init__(self, attn_scale: float, floor_scale: int):
        super().__init__()
        if floor_scale < 1:
            raise ValueError(f"config.json: floor_scale must be a positive integer, got {floor_scale}")
        self.attn_scale, self.floor_scale = float(attn_scale), int(floor_scale)
        self.active = True

    def fit_context(self, max_model_len: int) -> None:
        self.active = max_model_len >= self.floor_scale  # positions up to max_model_len - 1

    def forward(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return q
        factor = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * factor[:, None]).to(q.dtype)


class Llama4Attention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.temperature: NoPETemperature | None = None  # NoPE layers with attn_temperature_tuning (Llama4ForCausalLM)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.temperature is not None:  # NoPE layers rotate nothing: before or after that is the same
            q = self.temperature(positions, q)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary)), residual


class Llama4Layer(DecoderLayer):
    attention_class = Llama4Attention


class Llama4MoeBlock(SparseMoeBlock):
    """The routed experts (top 1, the token scaled by its router score before the expert) and the shared one."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        if facts["num_experts_per_tok"] != 1:
            raise ValueError(f"Llama 4 with num_experts_per_tok={facts['num_experts_per_tok']} is not supported "
                             "(only 1, as every released Llama 4)")
        super().__init__(hf_config, layer_idx, facts)
        self.shared_expert = DecoderMLP(hf_config, spec, intermediate_size=facts["moe_intermediate_size"])

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (scores [T, 1] in x's dtype: sigmoid of the chosen logit, ids [T, 1] int64); forced [T, 1]
        int16 (routing replay): rows with an id >= 0 take it, scored by its own logit."""
        logits = self.gate(x)  # [T, E], model dtype
        ids = logits.topk(1, dim=-1).indices
        if forced is not None:
            ids = torch.where(forced >= 0, forced.long(), ids)
        return torch.sigmoid(logits.gather(-1, ids).float()).to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        scores, ids = self.record_routes(x)
        routed = self.experts(x * scores, ids, torch.ones(ids.shape, dtype=torch.float32, device=x.device))
        routed = self.reduce(routed)
        return self.shared_expert.down(self.shared_expert.gate_up_proj(x)) + routed


class Llama4ForCausalLM(Qwen2MoeForCausalLM):
    layer_class = Llama4Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, rope_interleaved=True, rope_fp32=True, rope_fp32_tables=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        layers = self.model.layers
        interval = int(getattr(hf_config, "no_rope_layer_interval", 4) or 4)  # transformers' default: every 4th NoPE
        uses_rope = list(getattr(hf_config, "no_rope_layers", None) or
                         [int((i + 1) % interval != 0) for i in range(len(layers))])
        if len(uses_rope) < len(layers):
            raise ValueError(f"config.json: no_rope_layers has {len(uses_rope)} entries for {len(layers)} layers")
        chunk = getattr(hf_config, "attention_chunk_size", None)
        types = list(getattr(hf_config, "layer_types", None) or
                     ["chunked_attention" if rope and chunk else "full_attention" for rope in uses_rope])
        rope = layers[0].self_attn.rotary
        identity = identity_rotary(rope)
        eps = float(hf_config.rms_norm_eps)
        for layer, uses, kind in zip(layers, uses_rope, types):
            attn = layer.self_attn
            if not uses:
                attn.rotary = identity
                if getattr(hf_config, "attn_temperature_tuning", True):
                    attn.temperature = NoPETemperature(getattr(hf_config, "attn_scale", 0.1),
                                                       getattr(hf_config, "floor_scale", 8192))
            elif getattr(hf_config, "use_qk_norm", True):
                attn.rotary = RopeThenL2Norm(rope, identity, eps)
            if kind == "chunked_attention" and chunk:
                attn.attn.set_chunk(int(chunk))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts("Llama4ForCausalLM", self.config)
        if layer_idx in facts["moe_layers"]:
            return Llama4MoeBlock(self.config, layer_idx, facts, self.spec(self.config))
        return DecoderMLP(self.config, self.spec(self.config), intermediate_size=self.config.intermediate_size_mlp)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`feed_forward` -> `mlp`, the router -> `mlp.gate`; the stacked experts transposed to StackedExperts'
        [E, 2I, H] / [E, H, I] (gate | up rows: the checkpoint's last dim splits gate first)."""
        name = name.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.", ".mlp.")
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            tensor = tensor.transpose(1, 2)
        return ((name, tensor),)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The multimodal checkpoints (Scout, Maverick) served as their language model, built from `text_config`
    (model_config.TEXT_OF_MULTIMODAL): `language_model.*` renamed, `vision_model.*` and the projector skipped."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for text_name, text_tensor in language_model_parts(name, tensor):
            yield from super().checkpoint_parts(text_name, text_tensor)
