"""Granite causal LM (`GraniteForCausalLM`, IBM's Granite 3.x dense models): Llama's layers with four scalars from
the config, each applied where HF's GraniteModel applies it, with the same operation (so the same rounding):

- `embedding_multiplier`: the embeddings times it;
- `attention_multiplier`: the attention's softmax scale (instead of head_dim ** -0.5);
- `residual_multiplier`: each sub-block's output times it before the residual add (`residual + h * m`);
- `logits_scaling`: the logits divided by it.

The residual add is deferred into the next norm as in the other layers: a layer hands on `out * m` and the next
norm adds the residual, which is HF's `residual + hidden_states * residual_multiplier`.

HyperCLOVA X (`HyperCLOVAXForCausalLM`: NAVER's HyperCLOVAX-SEED): Granite's layers with an RMSNorm after each
sub-block (`post_norm1`, `post_norm2`, when `use_post_norm`) before the multiplier — `residual + post_norm(h) * m` —
and the logits *multiplied* by `logits_scaling`; `attention_multiplier` null is head_dim ** -0.5."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderSpec, _head_dim
from .layers import RMSNorm, RotaryEmbedding
from .llama import LlamaForCausalLM


class GraniteLayer(DecoderLayer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.residual_multiplier = float(hf_config.residual_multiplier)
        scale = getattr(hf_config, "attention_multiplier", None)
        self.self_attn.attn.scale = float(_head_dim(hf_config) ** -0.5 if scale is None else scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        x, residual = self.mlp(x * m, residual, self.post_attention_layernorm)
        return x * m, residual


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteLayer

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.embed_scale = float(hf_config.embedding_multiplier)
        self.logits_scaling = float(hf_config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling


class HyperCLOVAXLayer(GraniteLayer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        post = bool(getattr(hf_config, "use_post_norm", True))
        eps = float(hf_config.rms_norm_eps)
        self.post_norm1 = RMSNorm(hf_config.hidden_size, eps) if post else nn.Identity()
        self.post_norm2 = RMSNorm(hf_config.hidden_size, eps) if post else nn.Identity()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.residual_multiplier
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        x, residual = self.mlp(self.post_norm1(x) * m, residual, self.post_attention_layernorm)
        return self.post_norm2(x) * m, residual


class HyperCLOVAXForCausalLM(GraniteForCausalLM):
    layer_class = HyperCLOVAXLayer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return LlamaForCausalLM.compute_logits(self, hidden) * self.logits_scaling
