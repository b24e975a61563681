"""dots.llm1 (`Dots1ForCausalLM`: rednote-hilab's dots.llm1.base / .inst), as transformers computes it: Qwen3's
attention (per-head q/k RMSNorms before a whole-head rope, `attention_bias` on q, k, v and o) in Llama's pre-norm
layers; the first `first_k_dense_replace` layers dense, then DeepSeek-V3's sparse block (GLM-4-MoE's grouped sigmoid
router with its correction bias, kept in fp32; a shared expert; `routed_scaling_factor`); sliding windows where
`layer_types` says (Qwen2's `max_window_layers` rule; the released configs slide nowhere)."""

from __future__ import annotations

from .decoder import DecoderSpec
from .glm4_moe import Glm4MoeForCausalLM


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)
