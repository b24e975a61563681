"""LFM3 (`Lfm3ForCausalLM`: Liquid AI's LFM3-1.7B), as transformers computes it: LFM2's layers (lfm2.py: gated short
convolutions by `layer_types`' "conv", the w1 / w3 / w2 SwiGLU of `intermediate_size` as is, Llama's RMSNorms at
`norm_eps`, the final `embedding_norm`, a tied head) with

- sandwich norms (`use_sandwich_norm`): `post_operator_norm` on the operator's output and `post_ffn_norm` on the
  feed-forward's, before each residual add;
- a third layer kind, "sliding_attention": a window of `sliding_window`, and a rope per kind of layer
  (`rope_parameters` keyed by kind), rotate-half pairs computed in fp32 from fp32 tables; a "default" rope rotates
  the whole head whatever `partial_rotary_factor` says (transformers' LFM3 rotary ignores it there; "proportional"
  keeps its share);
- attention with Qwen3's names (q_norm / k_norm before the rope, o_proj) whose output is gated per head
  (`use_attention_gate`): out_h * sigmoid(g_proj(normed input))_h before o_proj (`self_attn.gate_proj` in
  checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid
from .decoder import DecoderSpec, rotary_per_layer_type, sandwich_mlp
from .hybrid_layer import pre_norm_block
from .layers import RMSNorm, RotaryEmbedding
from .lfm2 import Lfm2Attention, Lfm2ForCausalLM, Lfm2Layer, _eps
from .parallel import ColumnParallelLinear


class Lfm3Attention(Lfm2Attention):
    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.g_proj = None
        if getattr(hf_config, "use_attention_gate", True):  # one gate per head: this rank's heads
            self.g_proj = ColumnParallelLinear(hf_config.hidden_size, [hf_config.num_attention_heads])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.g_proj is None:
            return super().forward(positions, x, residual, norm)
        normed, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        q, k, v = self.qkv_proj(normed).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)  # [T, Hq * D]
        gate = sigmoid(self.g_proj(normed), self.batch_invariant)  # [T, Hq]
        out = (out.view(-1, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).view(-1, self.q_size)
        return self.o_proj(out), residual


class Lfm3Layer(Lfm2Layer):
    attention_class = Lfm3Attention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        sandwich = getattr(hf_config, "use_sandwich_norm", True)
        self.post_operator_norm = RMSNorm(hf_config.hidden_size, _eps(hf_config)) if sandwich else None
        self.post_ffn_norm = RMSNorm(hf_config.hidden_size, _eps(hf_config)) if sandwich else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.post_operator_norm is None:
            return super().forward(positions, x, residual)
        if self.linear:
            x, residual = pre_norm_block(self.input_layernorm, self.conv, x, residual)
        else:
            x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        return sandwich_mlp(self.mlp, x, residual, self.post_attention_layernorm, self.post_operator_norm,
                            self.post_ffn_norm)


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    layer_class = Lfm3Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, rope_fp32=True,
                           rope_fp32_tables=True)

    def __init__(self, hf_config):  # (a "default" rope's whole head: rope_settings.READS_PARTIAL_FACTOR)
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)

    def dense_width(self) -> int:
        return int(self.config.intermediate_size)  # no auto-adjustment

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().checkpoint_parts(name.replace(".self_attn.gate_proj.", ".self_attn.g_proj."), tensor)
