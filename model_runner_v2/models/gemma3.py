"""Gemma 3's text model (`Gemma3ForCausalLM`: Gemma-3-1B, and the text-only form of the larger ones): Gemma's
pieces (`gemma.py`: the (1 + weight) RMSNorms in fp32, GeGLU, the embedding scale rounded to the model dtype) in a
layer with four norms and per-head q/k norms, each as transformers' Gemma3 computes it:
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
(the residual adds deferred into the next norm, as GLM-4's sandwich, glm4.py). Attention: q_norm / k_norm over each
head ((1 + weight), before the rotation), the softmax scale query_pre_attn_scalar ** -0.5, and two kinds of layer
(`layer_types`, five "sliding_attention" layers to one "full_attention" in the released configs): the sliding ones
attend over the last `sliding_window` positions (Attention.set_window) with their own rope base
(rope_parameters["sliding_attention"], 10k), the full ones over everything with the global rope (1M, with its
scaling). Refused, never ignored: attention-logit or final-logit soft-capping (Gemma 2's; null in Gemma 3's configs)
and bidirectional attention (EmbeddingGemma)."""

from __future__ import annotations

import torch

from ...rope_settings import RopeSettings
from .decoder import DecoderAttention, DecoderLayer, DecoderMLP, DecoderSpec, norm_eps
from .gemma import GemmaForCausalLM
from .layers import RMSNorm, RotaryEmbedding


class Gemma3Attention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.q_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, norm_eps(hf_config), unit_offset=True)
        self.attn.scale = float(hf_config.query_pre_attn_scalar) ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = qkv.shape[0]
        # Each head normed on its own ([T, H, D]; the norm kernel on the fused path), then rotated without a norm.
        q = self.q_norm(q.view(tokens, self.num_heads, self.head_dim)).view(tokens, self.q_size)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)).view(tokens, self.kv_size)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary)), residual  # -> [T, H]


class Gemma3Layer(DecoderLayer):
    attention_class = Gemma3Attention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        hidden, eps = hf_config.hidden_size, norm_eps(hf_config)
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The blocks stay module calls: forward hooks see their outputs (entrypoints/diff/localize.py).
        attn, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        x, residual = self.mlp(self.post_attention_layernorm(attn), residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(x), residual


class Gemma3ForCausalLM(GemmaForCausalLM):
    layer_class = Gemma3Layer

    def __init__(self, hf_config):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(hf_config, name, None) is not None:
                raise ValueError(f"Gemma 3: {name}={getattr(hf_config, name)} is not supported (logit soft-capping)")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3: use_bidirectional_attention=true (an embedding model) is not supported")
        super().__init__(hf_config)
        types = list(hf_config.layer_types)
        if "sliding_attention" in types:  # one rotary per kind of layer, shared by the layers of that kind
            full = self.model.layers[0].self_attn.rotary
            settings = RopeSettings.from_hf_config(hf_config, layer_type="sliding_attention")
            local = RotaryEmbedding(full.head_dim, full.cos_cache.shape[0], settings)
            for layer, kind in zip(self.model.layers, types):
                if kind == "sliding_attention":
                    layer.self_attn.rotary = local

    def build_mlp(self, layer_idx: int) -> DecoderMLP:
        return DecoderMLP(self.config, self.spec(self.config),
                          act=getattr(self.config, "hidden_activation", None) or "gelu_pytorch_tanh")
