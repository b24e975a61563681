"""Solar Open (Upstage's `SolarOpenForCausalLM`: Solar-Open-100B), as transformers' SolarOpen computes it: GLM-4-MoE's
sparse block in every layer (the fp32 grouped sigmoid router with its correction bias, a shared expert:
glm4_moe.Glm4MoeBlock) under Llama's attention — q/k/v biases when `attention_bias`, none on o_proj, no q/k norm,
the whole head rotating (GLM's half-rotary default does not apply)."""

from __future__ import annotations

from .decoder import DecoderSpec
from .glm4_moe import Glm4MoeForCausalLM


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False, mlp_bias=False,
                           qk_norm=False)
