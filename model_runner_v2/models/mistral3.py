"""Ministral 3 (`Ministral3ForCausalLM`; `Mistral3ForConditionalGeneration`: Ministral-3-3B / 8B / 14B, and the
multimodal Mistral Small 3.1 / 3.2, Magistral Small, Devstral Small served as their language model).

The language model is Mistral's (Llama's layers, a sliding window where the config names one), and Ministral 3's
adds Llama 4's query temperature: past the YaRN pretraining context `original_max_position_embeddings`, each query
is multiplied by 1 + llama_4_scaling_beta * ln(1 + floor(position / original_max_position_embeddings)), as
transformers' Ministral3Attention does after the rotation. The engine multiplies before it (the rotation is linear:
the same product up to one rounding in bf16), and only where sequences can reach such positions (fit_context:
below them the factor is 1 and no kernel runs). Mistral Small's text config (model_type "mistral") names no beta: no
temperature."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderAttention, DecoderLayer, DecoderSpec
from .language_model import language_model_parts
from .layers import RMSNorm, RotaryEmbedding
from .llama import MistralForCausalLM


class QueryTemperature(nn.Module):
    """positions [T], q [T, Hq * D] -> q * (1 + beta * ln(1 + floor(positions / original))) per token, in q's dtype
    (the factor computed in fp32 and rounded to it, as transformers); q itself while `active` is off."""

    def __init__(self, beta: float, original: int):
        super().__init__()
        self.beta, self.original = beta, original
        self.active = bool(beta) and original > 0

    def fit_context(self, max_model_len: int) -> None:
        """No sequence reaches position `original`: the factor is 1 everywhere, nothing to compute."""
        self.active = bool(self.beta) and 0 < self.original < max_model_len

    def forward(self, positions: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return q
        factor = 1 + self.beta * torch.log(1 + torch.floor(positions.float() / self.original))  # [T] fp32
        return q * factor.to(q.dtype)[:, None]


def query_temperature(hf_config) -> QueryTemperature:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    original = int(params.get("original_max_position_embeddings") or 0)
    if beta and not original:
        raise ValueError("llama_4_scaling_beta needs rope_parameters' original_max_position_embeddings")
    return QueryTemperature(beta, original)


class Ministral3Attention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.temperature = query_temperature(hf_config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.temperature(positions, q)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary)), residual


class Ministral3Layer(DecoderLayer):
    attention_class = Ministral3Attention


class Ministral3ForCausalLM(MistralForCausalLM):
    layer_class = Ministral3Layer


class Mistral3ForConditionalGeneration(Ministral3ForCausalLM):
    """The multimodal checkpoints served as their language model: built from `text_config`
    (model_config.TEXT_OF_MULTIMODAL), the vision tower's and projector's tensors skipped (language_model.py)."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)
