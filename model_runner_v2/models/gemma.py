"""Gemma causal LM (`GemmaForCausalLM`: Gemma 2B / 7B, CodeGemma): Llama's layers with Gemma's three differences
from it, each as transformers computes it:
- its RMSNorms scale by (1 + weight), in fp32, before one cast (`RMSNorm(unit_offset=True)`, torch ops);
- a GeGLU MLP (`gelu_pytorch_tanh`; transformers maps the legacy `gelu` of the released configs to it);
- the embeddings times sqrt(hidden_size), that factor first rounded to the model dtype (HF's `normalizer`).
Gemma 2 and 3 (logit soft-capping, sliding-window layers) are other architectures, not served here."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps
from .layers import RMSNorm


class GemmaLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), unit_offset=True)


class GemmaForCausalLM(DecoderLM):
    layer_class = GemmaLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        # built under the model's dtype (loader._default_dtype): sqrt(H) rounded to it, as HF's normalizer tensor
        scale = torch.tensor(hf_config.hidden_size**0.5, dtype=torch.get_default_dtype(), device="cpu")
        self.model.embed_scale = float(scale)
