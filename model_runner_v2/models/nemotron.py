"""Nemotron (`NemotronForCausalLM`: Nemotron-3-8B, Nemotron-4-15B / 340B, Minitron-4B / 8B, Nemotron-Mini-4B), as
transformers computes it: Llama's layer order and projections (biases when `attention_bias` / `mlp_bias`), LayerNorm1P
norms (LayerNorm with a bias, scaled by `weight + 1` rounded to the model dtype; `norm_eps`), half of each head rotating
(`partial_rotary_factor`, 0.5 when the config names none, as NemotronConfig), and an ungated ReLU² MLP (up_proj,
relu(x)^2, down_proj)."""

from __future__ import annotations

from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps
from .layers import LayerNorm
from .plain_mlp import PlainMLP

NEMOTRON_PARTIAL_ROTARY = 0.5  # NemotronConfig's default


class NemotronLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, norm_eps(hf_config), unit_offset=True)


class NemotronForCausalLM(DecoderLM):
    layer_class = NemotronLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
                           qk_norm=False, partial_rotary_factor=NEMOTRON_PARTIAL_ROTARY)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("up_proj", "down_proj"), "Nemotron", ("relu2",), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", False)))
