"""Cohere (`CohereForCausalLM`: Command-R, Aya-23, Aya Expanse): StableLM's parallel layer (one norm,
then attention and the MLP on the same normed input, HF's `(residual + attn) + mlp`) with Cohere's LayerNorm
(mean-centred, a weight and no bias, in fp32 with one cast), a rotary over interleaved pairs computed in fp32 with
one rounding (HF's apply_rotary_pos_emb upcasts q and k: RotaryEmbedding(fp32_math=True)), tied embeddings, and the
logits times `logit_scale`; Command-R+'s per-head q/k LayerNorms (`use_qk_norm`: head_norm.py, CohereLayerNorm((heads,
head_dim)) as transformers builds it). Cohere 2 (Command R7B, Command A): the same layers, sliding windows in three
of four, no rotary in the others."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderLM, DecoderSpec, norm_eps
from .head_norm import HeadNormAttention
from .layers import RotaryEmbedding
from .smollm3 import without_rotary
from .stablelm import ParallelMLP, StableLmLayer


class CohereLayerNorm(nn.Module):
    """HF's CohereLayerNorm op for op: x in fp32, minus its mean, times rsqrt(variance + eps), times the fp32
    weight, cast back once. The methods the decoder calls on a norm (RMSNorm's), with the same meanings."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _normed32(self, x32: torch.Tensor) -> torch.Tensor:
        mean = x32.mean(-1, keepdim=True)
        variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
        return self.weight.to(torch.float32) * ((x32 - mean) * torch.rsqrt(variance + self.eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._normed32(x.to(torch.float32)).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual  # the model dtype, HF's `residual + h`
        return self(x), x

    def add_and_norm_fp32(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """enable_fp32_lm_head's final norm: the add and the norm in fp32, left in fp32."""
        return self._normed32(x.float() + residual.float())


class CohereAttention(HeadNormAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        names = ("q_norm", "k_norm") if getattr(hf_config, "use_qk_norm", False) else None
        super().__init__(hf_config, spec, layer_idx, rotary, names, norm_eps(hf_config))


class CohereLayer(StableLmLayer):
    attention_class = CohereAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.parallel = True  # Cohere's layer is always parallel (no use_parallel_residual switch)
        self.post_attention_layernorm = None

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return CohereLayerNorm(hf_config.hidden_size, norm_eps(hf_config))


class CohereForCausalLM(DecoderLM):
    layer_class = CohereLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, rope_interleaved=True, rope_fp32=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.logit_scale = float(getattr(hf_config, "logit_scale", 1.0))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return ParallelMLP(self.config, self.spec(self.config))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.logit_scale  # HF's `logits * logit_scale`, the logits' dtype


class Cohere2ForCausalLM(CohereForCausalLM):
    """Cohere 2 (`Cohere2ForCausalLM`: Command R7B, Command A): Cohere's layers, a sliding window in the layers
    `layer_types` calls sliding (three of every four; model_config) and no rotary in the full ones (their attention
    gets an identity rotary, smollm3.without_rotary, as SmolLM3's NoPE layers)."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        without_rotary(layer for layer, kind in zip(self.model.layers, hf_config.layer_types)
                       if kind != "sliding_attention")
