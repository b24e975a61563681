"""MiniCPM5 MoE (`MiniCPM5MoeForCausalLM`: OpenBMB's MiniCPM5-15B-A2.5B; transformers' config renames the older
`MiniCPM5MoEForCausalLM`), as transformers computes it: DeepSeek-V3's decoder (Llama's pre-norm layers; GLM-4-MoE's
grouped corrected-sigmoid router in fp32, renormalised, times `routed_scaling_factor`, with ungated shared experts;
the layers `mlp_layer_types` calls dense a SwiGLU of `intermediate_size`) under plain GQA attention whose output is
gated per element: one projection gives each head [q_h | gate_h] (stored as `q_proj` [2 x heads x D, hidden]), the
whole head rotates, and o_proj reads out * sigmoid(gate). None of the older MiniCPMs' muP scalars."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ...kernels.activation import sigmoid
from .decoder import DecoderAttention, DecoderLayer, DecoderSpec
from .glm4_moe import Glm4MoeForCausalLM
from .layers import RMSNorm, RotaryEmbedding
from .parallel import ColumnParallelLinear


class GatedOutputAttention(DecoderAttention):
    """Llama's attention with Qwen3-Next's output gate (no q/k norms): qkv_proj holds [q_h | gate_h] per head, then
    k, then v (each part split between the ranks by whole heads)."""

    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.qkv_proj = ColumnParallelLinear(hf_config.hidden_size, [2 * heads * self.head_dim,
                                             kv_heads * self.head_dim, kv_heads * self.head_dim], bias=spec.qkv_bias)
        self.q_rows = 2 * self.q_size  # the checkpoint's q_proj rows: DecoderLM._fused_shards

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)
        qg, k, v = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(-1, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim].reshape(-1, self.q_size), qg[..., self.head_dim:].reshape(-1, self.q_size)
        out = self.attn(positions, q, k, v, self.rotary)  # [T, Hq * D]
        return self.o_proj(out * sigmoid(gate, self.batch_invariant)), residual


class MiniCPM5MoeLayer(DecoderLayer):
    attention_class = GatedOutputAttention


class MiniCPM5MoeForCausalLM(Glm4MoeForCausalLM):
    layer_class = MiniCPM5MoeLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        if getattr(hf_config, "use_gated_attention", True) is False:
            raise ValueError("MiniCPM5MoeForCausalLM: use_gated_attention=false is not supported (transformers "
                             "refuses it too)")
        return DecoderSpec.with_attention_bias(hf_config, partial_rotary_factor=1.0)  # GLM's 0.5 not taken

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # transformers' module is `q_gate_proj` (LLM.load_weights from a module), its checkpoints' `q_proj`
        return super().checkpoint_parts(name.replace(".self_attn.q_gate_proj.", ".self_attn.q_proj."), tensor)


