"""Qwen2 / Qwen2.5 causal LM: bias on q/k/v (not on o_proj), no q/k norm."""

from __future__ import annotations

from .decoder import DecoderLM, DecoderSpec


class Qwen2ForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
