"""Ernie 4.5 dense (`Ernie4_5ForCausalLM`: ERNIE-4.5-0.3B): Llama's layers with a bias on every projection when
`use_bias`, and the whole head rotating in interleaved pairs (2i, 2i + 1) in fp32: transformers' Ernie 4.5 keeps
cos/sin in fp32 and rounds the rotated q/k once (RotaryEmbedding(fp32_math, fp32_tables))."""

from __future__ import annotations

from .decoder import DecoderSpec
from .llama import LlamaForCausalLM


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "use_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False, rope_interleaved=True,
                           rope_fp32=True, rope_fp32_tables=True)
