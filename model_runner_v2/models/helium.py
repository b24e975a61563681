"""Helium (`HeliumForCausalLM`: Kyutai's Helium-1 2B), as transformers computes it: Llama's layers whose RMSNorms
multiply the weight into the fp32 normed row before the one cast (OLMo 2's order: RMSNorm(weight_in_fp32=True)),
the rotary in interleaved pairs (2i, 2i + 1) over the whole head (GLM's), q/k/v biases when `attention_bias` but never
one on o_proj (HeliumAttention's), MLP biases when `mlp_bias`."""

from __future__ import annotations

from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps
from .layers import RMSNorm


class HeliumLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), weight_in_fp32=True)


class HeliumForCausalLM(DecoderLM):
    layer_class = HeliumLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False,
                           mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False,
                           rope_interleaved=True)
