"""OLMoE causal LM (`OlmoeForCausalLM`, AI2's OLMoE-1B-7B): Llama's pre-norm layers, q/k RMSNorms over whole
projections (Llama's norm order) with an optional clamp of q, k and v at +-clip_qkv, and a sparse MoE block in
every layer (moe.py: `num_experts` experts of width `intermediate_size`, top-k renormalised when
`norm_topk_prob`). Its checkpoints name experts as Qwen3-MoE's do (mlp.experts.E.{gate,up,down}_proj), so
Qwen3MoeForCausalLM's weight mapping places them. FlexOlmo (`FlexOlmoForCausalLM`: FlexOlmo-7x7B): OLMo 2's layers
(post-norms in OLMo 2's order, its whole-projection q/k norms) around OLMoE's sparse block."""

from __future__ import annotations

import torch

from .decoder import DecoderLayer, DecoderSpec
from .layers import RMSNorm, RotaryEmbedding
from .llama import LlamaForCausalLM
from .olmo2 import Olmo2ForCausalLM, Olmo2Layer, WholeQKNormAttention
from .qwen3_moe import Qwen3MoeForCausalLM


class OlmoeAttention(WholeQKNormAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary, weight_in_fp32=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input norm (after the deferred residual add), then the block: (output [T, H], residual)."""
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)
        return self.attend(positions, qkv), residual


class OlmoeLayer(DecoderLayer):
    attention_class = OlmoeAttention


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    layer_class = OlmoeLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return LlamaForCausalLM.spec(hf_config)


class FlexOlmoForCausalLM(OlmoeForCausalLM):
    layer_class = Olmo2Layer  # its sparse block takes the place of Olmo2MLP ([T, H] -> [T, H], no norm before it)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return Olmo2ForCausalLM.spec(hf_config)
