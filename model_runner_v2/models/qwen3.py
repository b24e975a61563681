"""Qwen3 causal LM: per-head q/k RMSNorm before rope, no qkv bias, head_dim from the config."""

from __future__ import annotations

from .decoder import DecoderLM, DecoderSpec


class Qwen3ForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)
