"""Gemma 3's text model (`Gemma3ForCausalLM`: Gemma-3-1B, and the text-only form of the larger ones): Gemma 2's
layer (gemma2.py: four (1 + weight) norms, query_pre_attn_scalar, the optional soft-capping, sliding layers from
`layer_types`) with per-head (1 + weight) q/k norms before the rotation, and a rope per kind of layer: the sliding
ones (five of every six in the released configs) rotate with rope_parameters["sliding_attention"] (10k), the full
ones with the global rope (1M, with its scaling). The multimodal checkpoints (Gemma3ForConditionalGeneration) serve
their language model."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .decoder import DecoderSpec, norm_eps, rotary_per_layer_type
from .gemma2 import Gemma2Attention, Gemma2ForCausalLM, Gemma2Layer
from .language_model import language_model_parts
from .layers import RMSNorm, RotaryEmbedding


class Gemma3Attention(Gemma2Attention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.q_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = qkv.shape[0]
        # Each head normed on its own ([T, H, D]; the norm kernel on the fused path), then rotated without a norm.
        q = self.q_norm(q.view(tokens, self.num_heads, self.head_dim)).view(tokens, self.q_size)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)).view(tokens, self.kv_size)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary)), residual  # -> [T, H]


class Gemma3Layer(Gemma2Layer):
    attention_class = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_class = Gemma3Layer

    def __init__(self, hf_config):
        super().__init__(hf_config)
        rotary_per_layer_type(self.model, hf_config)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma-3-4B / 12B / 27B (multimodal checkpoints) served as their language model alone: built from the config's
    `text_config` (model_config.TEXT_OF_MULTIMODAL), the checkpoint's language-model tensors renamed to
    Gemma3ForCausalLM's, the vision tower's and projector's skipped (language_model.py). Text in, text out: no image
    input."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)
