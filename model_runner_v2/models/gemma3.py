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
    """Gemma 2's attention with per-head (1 + weight) q/k norms (`unit_offset`, in fp32) before the rotation:
    DecoderAttention's q/k-norm path, so on the fused path the norms, the rotation and the KV write are one kernel
    (kernels/rotary.py, NORM_UNIT_OFFSET)."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.q_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)
        self.qk_norm = True


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
