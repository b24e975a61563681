"""MiniCPM3 (`MiniCPM3ForCausalLM`: OpenBMB's MiniCPM3-4B), as transformers computes it: DeepSeek's latent attention
(models/mla.py: a q LoRA, the latent norms at 1e-6, rotate-half pairs over each head's last `qk_rope_head_dim`
elements in the model dtype) over Llama's dense SwiGLU layers, with MiniCPM's three muP scalars:

- the embeddings times `scale_emb`;
- each sub-block's output times scale_depth / sqrt(num_hidden_layers) before the residual add (Granite's
  residual_multiplier: `residual + h * m`);
- the final norm's output divided by hidden_size / dim_model_base *before* the LM head (not the logits after it).
No attention multiplier: the softmax scale is MLA's (qk_nope + qk_rope)^-0.5."""

from __future__ import annotations

import math

import torch

from .decoder import DecoderSpec
from .deepseek import DeepseekV3ForCausalLM, MlaDecoderLayer
from .granite import GraniteLayer
from .layers import RotaryEmbedding
from .mla import mla_dims


class MiniCPM3Layer(MlaDecoderLayer):
    forward = GraniteLayer.forward  # residual + h * m after attention and after the MLP

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        depth = getattr(hf_config, "scale_depth", None)
        layers = hf_config.num_hidden_layers
        self.residual_multiplier = (math.sqrt(layers) if depth is None else float(depth)) / math.sqrt(layers)


class MiniCPM3ForCausalLM(DeepseekV3ForCausalLM):
    layer_class = MiniCPM3Layer
    checkpoint_fp32_suffixes = ()  # dense: no router

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        nope, rope, _ = mla_dims(hf_config)
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
                           qk_norm=False, head_dim=nope + rope, rotary_dim=rope)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.embed_scale = float(getattr(hf_config, "scale_emb", 1.0) or 1.0)
        base = getattr(hf_config, "dim_model_base", None)
        self.hidden_divisor = float(hf_config.hidden_size / (hf_config.hidden_size if base is None else base))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden / self.hidden_divisor)  # HF's `hidden_states / logits_scaling`
