"""MiMo-V2-Flash (`MiMoV2FlashForCausalLM`: Xiaomi's 309B-A15B), as transformers' MiMoV2Flash computes it: GLM-4-MoE's
layers and router without shared experts (fp32 sigmoid scores plus a correction choose the top k, renormalised,
times `routed_scaling_factor`; layer 0 and the others `mlp_layer_types` calls dense run a SwiGLU), around an
attention of its own:

- q/k heads of `head_dim` (192), V heads of `v_head_dim` (128) scaled by `attention_value_scale` after the
  projection (the model dtype), padded with zeros to head_dim in the KV cache and cut back before o_proj (MLA's way:
  zero columns add nothing); the softmax scale head_dim^-0.5; q/k/v biased when `attention_bias`, o_proj never;
- full and sliding layers by `layer_types` (a window of `sliding_window` keys), each kind its own rope
  (rope_parameters per kind: 5e6 / 1e4, a third of each head rotating: rotate-half over int(head_dim * 0.334));
- sliding layers: twice the KV heads (their own KV cache shape: gemma4_facts.mimo_layers) and an attention sink per
  q head (`self_attn.attention_sink_bias` in the files, `self_attn.sinks` in transformers' modules).

The multi-token-prediction layers (`model.mtp.*`) are skipped, as transformers skips them. Piecewise CUDA graphs are
refused (gemma4_facts.resolve_gemma4_options: FULL_DECODE_ONLY by default)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...gemma4_facts import mimo_layers
from ..attention import Attention
from .decoder import DecoderLayer, DecoderSpec, rotary_per_layer_type
from .glm4_moe import Glm4MoeForCausalLM
from .layers import RMSNorm, RotaryEmbedding
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state, mark_sharded
from .per_layer_shards import PerLayerShards


class MiMoV2FlashAttention(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        plan, tp = mimo_layers(hf_config)[layer_idx], get_tp_state().size
        heads, kv_heads = int(hf_config.num_attention_heads), plan.kv_heads
        self.head_dim = plan.head_dim
        self.v_dim = int(getattr(hf_config, "v_head_dim", None) or self.head_dim)
        self.num_heads = divide(heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, tp, "a layer's KV heads")
        self.q_size, self.k_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.v_size = self.num_kv_heads * self.v_dim
        parts = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.v_dim]
        self.qkv_proj = ColumnParallelLinear(hf_config.hidden_size, parts, bias=spec.qkv_bias)  # q | k | v rows
        self.o_proj = RowParallelLinear(heads * self.v_dim, hf_config.hidden_size, bias=False)
        scale = getattr(hf_config, "attention_value_scale", None)
        self.v_scale = 1.0 if scale is None else float(scale)
        self.rotary = rotary  # the full layers' (rotary_per_layer_type gives the sliding ones theirs)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        if plan.kind == "sliding_attention":
            self.attn.enable_sinks()  # this rank's heads' sinks
            mark_sharded(self.attn.sinks, 0, get_tp_state(), heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, q + k + v]
        q, k, v = qkv.split([self.q_size, self.k_size, self.v_size], dim=-1)
        v = v.reshape(-1, self.num_kv_heads, self.v_dim) * self.v_scale  # transformers' product, in the model dtype
        v = F.pad(v, (0, self.head_dim - self.v_dim)).reshape(-1, self.k_size)  # zeros past v_head_dim
        out = self.attn(positions, q, k, v, self.rotary)  # [T, Hq * head_dim]
        out = out.view(-1, self.num_heads, self.head_dim)[..., : self.v_dim].reshape(-1, self.num_heads * self.v_dim)
        return self.o_proj(out), residual


class MiMoV2FlashLayer(DecoderLayer):
    attention_class = MiMoV2FlashAttention


class MiMoV2FlashForCausalLM(PerLayerShards, Glm4MoeForCausalLM):  # KV heads differ by layer kind
    layer_class = MiMoV2FlashLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False, mlp_bias=False,
                           qk_norm=False)

    def __init__(self, hf_config):
        mimo_layers(hf_config)  # a bad layer plan refused before anything is built
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.mtp."):
            return ()
        parts = name.split(".")
        if parts[-2:] in (["self_attn", "attention_sink_bias"], ["self_attn", "sinks"]):
            return ((".".join(parts[:-1] + ["attn", "sinks"]), tensor),)
        return super().checkpoint_parts(name, tensor)
