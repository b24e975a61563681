"""Llama causal LM: GQA, optional attention/MLP biases, tied or untied head, llama3 rope scaling; Mistral; Ministral;
Seed-OSS; Arcee."""

from __future__ import annotations

from torch import nn

from .decoder import DecoderLM, DecoderSpec
from .plain_mlp import PlainMLP


class LlamaForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, qk_norm=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers and weight names, and its sliding window in every layer (Attention.fit_context)."""


class MinistralForCausalLM(MistralForCausalLM):
    """Ministral (transformers' `MinistralForCausalLM`, Ministral-8B-2410's layers): Mistral's, the window only in the
    layers `layer_types` calls sliding (model_config)."""


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS (ByteDance's Seed-OSS-36B): Llama's layers with the q/k/v bias (`attention_bias`, on by default) apart
    from the o_proj one (`attention_out_bias`, off by default)."""

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", True)),
                           o_bias=bool(getattr(hf_config, "attention_out_bias", False)),
                           mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False)


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee (AFM-4.5B): Llama's layers with an ungated MLP, down_proj(relu(up_proj(x))^2) (transformers' ArceeMLP,
    Nemotron's)."""

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("up_proj", "down_proj"), "Arcee", ("relu2",), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", False)))
