"""OLMo (`OlmoForCausalLM`: OLMo-1B-hf, OLMo-7B-hf, OLMo-7B-0424-hf / 0724-hf; OLMo 2 and 3 are olmo2.py), as
transformers computes it: Llama's layers and weight names, with LayerNorms that have no weight and no bias, computed
in fp32 at eps 1e-5 whatever the config says (transformers' OlmoLayerNorm), and `clip_qkv`: q, k and v clamped to
[-clip, clip] after their projections, before rope (DecoderSpec.clip_qkv). The rotary as every transformers OLMo
computes it: its cos / sin tables kept fp32 (not cast to the model dtype) and the rotation in fp32, rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import DecoderLayer, DecoderSpec
from .layers import LayerNorm
from .llama import LlamaForCausalLM

OLMO_NORM_EPS = 1e-5  # transformers' OlmoLayerNorm: fixed, the config names none


class ParameterFreeLayerNorm(LayerNorm):
    """(x - mean) / sqrt(var + eps) in fp32, cast back to x's dtype; nothing learned (no weight, no bias). LayerNorm's
    forward / add_and_norm / norm_then with no parameters (kernels/layer_norm.py: the torch path is HF's op)."""

    def __init__(self, eps: float = OLMO_NORM_EPS):
        nn.Module.__init__(self)  # not LayerNorm's: it would make a weight and a bias
        self.eps = eps
        self.unit_offset = False

    def params(self) -> tuple[None, None]:
        return None, None

    def add_and_norm_fp32(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float() + residual.float(), (x.shape[-1],), None, None, self.eps)


class OlmoLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return ParameterFreeLayerNorm()


class OlmoForCausalLM(LlamaForCausalLM):
    layer_class = OlmoLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        clip = getattr(hf_config, "clip_qkv", None)
        if clip is not None and not clip > 0:
            raise ValueError(f"OLMo's clip_qkv must be positive or null, got {clip}")
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, rope_fp32=True,
                           rope_fp32_tables=True, clip_qkv=None if clip is None else float(clip))
