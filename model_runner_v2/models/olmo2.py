"""OLMo 2 causal LM (`Olmo2ForCausalLM`, AI2's OLMo-2 models): Llama's projections and rope, with the norms moved
after the sub-blocks and q/k norms over whole projections.

A layer (HF's Olmo2DecoderLayer):  h = x + post_attention_layernorm(attn(x));  out = h + post_feedforward_layernorm(
mlp(h)). No norm before either sub-block. In attention, q_norm and k_norm are RMSNorms over all of q_proj's and
k_proj's output (Hq * D and Hkv * D wide, not per head), before rope. Every OLMo2 RMSNorm multiplies its weight
into the fp32 normed row and casts once (Llama's casts first): RMSNorm(weight_in_fp32=True).

As the other layers, the residual add is deferred: a layer returns (post_feedforward_layernorm(mlp(h)), h) and the
next layer (or the final norm) adds the two, which is HF's `residual + hidden_states` (one add, the same rounding).
The q/k norms span every head: under tensor parallelism the ranks all-reduce each row's sum of squares first."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderAttention, DecoderLM, DecoderMLP, DecoderSpec, rotary_per_layer_type
from .layers import RMSNorm, RotaryEmbedding
from .parallel import all_reduce, get_tp_state, mark_sharded


class WholeQKNormAttention(DecoderAttention):
    """Attention whose q and k RMSNorms span whole projections (OLMo 2, OLMoE), then an optional clamp of q, k and v
    at +-clip_qkv (OLMoE's config), then rope. `attend` takes the qkv projection's output; the subclasses say what
    comes before it (a pre-norm or none)."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, weight_in_fp32: bool):
        super().__init__(hf_config, spec, layer_idx, rotary)
        eps, state = hf_config.rms_norm_eps, get_tp_state()
        self.tp_size = state.size
        self.q_norm = RMSNorm(self.q_size, eps, weight_in_fp32=weight_in_fp32)  # [Hq * D]: every head at once
        self.k_norm = RMSNorm(self.kv_size, eps, weight_in_fp32=weight_in_fp32)
        if state.size > 1:  # this rank's heads' part of each weight (the rows of q and k it computes)
            mark_sharded(self.q_norm.weight, 0, state, self.q_size * state.size)
            mark_sharded(self.k_norm.weight, 0, state, self.kv_size * state.size)
        clip = getattr(hf_config, "clip_qkv", None)
        self.clip_qkv = None if clip is None else float(clip)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:  # [T, (Hq + 2 Hkv) D] -> [T, H]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm(q, self.q_norm), self._norm(k, self.k_norm)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return self.o_proj(self.attn(positions, q, k, v, self.rotary))

    def _norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """norm(x) over the whole projection. Under tensor parallelism a rank holds only its heads' columns: the
        sum of squares is all-reduced over the ranks, then each rank scales its own columns (in fp32; the weight
        before or after the cast as the norm says)."""
        if self.tp_size == 1:
            return norm(x)
        x32 = x.float()  # [T, local width]
        total = all_reduce(x32.pow(2).sum(-1, keepdim=True))  # [T, 1]: the whole width's sum of squares
        x32 = x32 * torch.rsqrt(total / (x.shape[-1] * self.tp_size) + norm.eps)
        if norm.weight_in_fp32:
            return (norm.weight.float() * x32).to(x.dtype)
        return norm.weight * x32.to(x.dtype)


class Olmo2Attention(WholeQKNormAttention):
    """No norm before it; OLMo2's RMSNorm order in the q/k norms."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary, weight_in_fp32=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.attend(positions, self.qkv_proj(x))


class Olmo2MLP(DecoderMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H], no norm before it
        return self.down(self.gate_up_proj(x))


class Olmo2Layer(nn.Module):
    attention_class: type[nn.Module] = Olmo2Attention  # [T, H] -> [T, H], no norm before it (EXAONE 4's: exaone4.py)
    norm_weight_in_fp32 = True  # OLMo2's RMSNorm order (EXAONE 4's post norms are Llama's)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.self_attn = self.attention_class(hf_config, spec, layer_idx, rotary)
        self.mlp = mlp
        self.post_attention_layernorm = self.make_norm(hf_config)
        self.post_feedforward_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        """The layer's two norms and the model's final one (DecoderLayer.make_norm's role), in this layer's order."""
        return RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, weight_in_fp32=cls.norm_weight_in_fp32)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual  # the previous layer's deferred add
        h = h + self.post_attention_layernorm(self.self_attn(positions, h))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(DecoderLM):
    layer_class = Olmo2Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        # q/k norms: Olmo2Attention; transformers' OLMo rotaries keep their cos / sin fp32 and round the rotation once
        return DecoderSpec.with_attention_bias(hf_config, rope_fp32=True, rope_fp32_tables=True)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return Olmo2MLP(self.config, self.spec(self.config))


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's layers with a sliding window in the layers `layer_types` calls sliding
    (three of every four; model_config) and a rope per kind of layer (rotary_per_layer_type: the full layers' may
    carry the long-context scaling)."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)
