"""nanochat (`NanoChatForCausalLM`: Karpathy's nanochat-d20 / d32), as transformers' NanoChat computes it:

- every RMSNorm weightless (x * rsqrt(mean(x^2) + eps) in fp32, rounded: llama4.WeightlessRMSNorm), one more on the
  embeddings before the first layer (DecoderModel.embed_norm);
- the rope with nanochat's rotate_half (cat(x2, -x1): a rotation by -theta, so its sin table negated), then each q and
  k head RMS-normed (llama4.RopeThenL2Norm: the rope, then the identity rotary with the norms);
- an ungated ReLU² MLP without biases (`mlp.fc1`, `mlp.fc2`), Llama's pre-norm layers;
- the logits capped at +-`final_logit_softcapping` (cap * tanh(logits / cap), Gemma 2's three ops)."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderLayer
from .llama import LlamaForCausalLM
from .llama4 import RopeThenL2Norm, WeightlessRMSNorm
from .plain_mlp import PlainMLP
from .smollm3 import identity_rotary


class NanoChatLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return WeightlessRMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))


class NanoChatForCausalLM(LlamaForCausalLM):
    layer_class = NanoChatLayer

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.embed_norm = NanoChatLayer.make_norm(hf_config)
        rope = self.model.layers[0].self_attn.rotary
        if rope.settings.rope_type != "default":
            raise ValueError(f"nanochat with {rope.settings.rope_type} rope scaling is not supported")
        with torch.no_grad():
            rope.sin_cache.neg_()  # nanochat's rotate_half turns the other way
        rotary = RopeThenL2Norm(rope, identity_rotary(rope), float(hf_config.rms_norm_eps))
        for layer in self.model.layers:
            layer.self_attn.rotary = rotary
        self.final_logit_softcapping = float(getattr(hf_config, "final_logit_softcapping", None) or 0.0)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("fc1", "fc2"), "nanochat", ("relu2",), "relu2", bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
