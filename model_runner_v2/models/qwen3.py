"""Qwen3 causal LM: per-head q/k RMSNorm before rope, no qkv bias, head_dim from the config."""

from __future__ import annotations

from .decoder import DecoderLM, DecoderSpec


class Qwen3ForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
