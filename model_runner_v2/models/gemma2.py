"""Gemma 2 (`Gemma2ForCausalLM`: Gemma-2-2B / 9B / 27B): Gemma's pieces (`gemma.py`: the (1 + weight) RMSNorms in
fp32, GeGLU, the embedding scale rounded to the model dtype) in a layer with four norms, each as transformers'
Gemma2 computes it:
    h = x + post_attention_layernorm(attn(input_layernorm(x)))
    out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))
(the residual adds deferred into the next norm, as GLM-4's sandwich, glm4.py). Attention: the softmax scale
query_pre_attn_scalar ** -0.5, scores capped at +-attn_logit_softcapping (cap * tanh(s / cap): Attention.softcap, in
every attention path), and sliding windows in the layers `layer_types` calls sliding (every other one). The logits
are capped the same way at final_logit_softcapping, in the logits' dtype, as transformers does. Gemma 3
(gemma3.py) is this layer with per-head q/k norms and a rope per kind of layer. VaultGemma (`VaultGemmaForCausalLM`:
Google's differentially private VaultGemma-1B) is Gemma 2 with only the norms before the sub-blocks
(`input_layernorm`, `pre_feedforward_layernorm`)."""

from __future__ import annotations

import torch

from .decoder import DecoderAttention, DecoderMLP, DecoderSpec
from .gemma import GemmaForCausalLM, GemmaLayer
from .layers import RotaryEmbedding


class Gemma2Attention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.attn.scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        self.attn.softcap = float(getattr(hf_config, "attn_logit_softcapping", None) or 0.0)


class Gemma2Layer(GemmaLayer):
    attention_class = Gemma2Attention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.pre_feedforward_layernorm = self.make_norm(hf_config)
        self.post_feedforward_layernorm = self.make_norm(hf_config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The blocks stay module calls: forward hooks see their outputs (entrypoints/diff/localize.py).
        attn, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        # post-attention norm, residual add, pre-feedforward norm: one kernel on the fused path (RMSNorm.add_and_norm)
        x, residual = self.mlp(attn, residual, self.pre_feedforward_layernorm, first=self.post_attention_layernorm)
        return self.post_feedforward_layernorm(x), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_class = Gemma2Layer

    def __init__(self, hf_config):
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention=true (an embedding model) is not "
                             "supported")
        super().__init__(hf_config)
        self.final_logit_softcapping = float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)

    def build_mlp(self, layer_idx: int) -> DecoderMLP:
        return DecoderMLP(self.config, self.spec(self.config),
                          act=getattr(self.config, "hidden_activation", None) or "gelu_pytorch_tanh")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits  # transformers' three ops, in the logits' dtype


class VaultGemmaLayer(Gemma2Layer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        del self.post_attention_layernorm, self.post_feedforward_layernorm  # VaultGemma has neither

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        return self.mlp(attn, residual, self.pre_feedforward_layernorm)


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    layer_class = VaultGemmaLayer
