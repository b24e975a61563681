"""GLM causal LMs: `GlmForCausalLM` (GLM-4-9B-chat's HF form) and `Glm4ForCausalLM` (GLM-4-0414, GLM-Z1).

Both: Llama's attention with a bias on q/k/v (`attention_bias`, on by default) and none on o_proj; a rotary over
half of each head (`partial_rotary_factor`, 0.5 when the config names none, as transformers' GLM configs set it)
whose pairs are interleaved, (2i, 2i + 1) (RotaryEmbedding(interleaved=True)); the gate and up projections stored
fused as `mlp.gate_up_proj` (split as Phi-3's, phi3.split_fused_parts).

GLM-4's layer adds a norm after each sub-block ("sandwich" norms, HF's Glm4DecoderLayer):
    h = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    out = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))
As in the other layers, each residual add is deferred into the next norm: the layer returns
(post_mlp_layernorm(mlp(...)), h) and the next norm adds the two (HF's `residual + hidden_states`, one rounding)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .decoder import DecoderLayer, DecoderSpec, sandwich_mlp
from .layers import RMSNorm
from .llama import LlamaForCausalLM
from .phi3 import split_fused_parts


class GlmForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", True)), o_bias=False, mlp_bias=False,
                           qk_norm=False, rope_interleaved=True, partial_rotary_factor=0.5)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return split_fused_parts(self.config, name, tensor)


class Glm4Layer(DecoderLayer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.post_self_attn_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The blocks stay module calls: forward hooks see their outputs (entrypoints/diff/localize.py).
        attn, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        # post-self-attention norm, residual add, post-attention norm: one kernel on the fused path in a large step
        # (RMSNorm.add_and_norm); a small step's GEMV takes the second norm
        return sandwich_mlp(self.mlp, attn, residual, self.post_attention_layernorm, self.post_self_attn_layernorm,
                            self.post_mlp_layernorm)  # a sparse block too (Kolibri-1's)


class Glm4ForCausalLM(GlmForCausalLM):
    layer_class = Glm4Layer
