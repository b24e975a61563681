"""StarCoder2 (`Starcoder2ForCausalLM`: StarCoder2-3B / 7B / 15B): Llama's layer order (attention, then the MLP, each
after its own norm and added to the residual stream) with LayerNorms with biases (layers.LayerNorm, `norm_epsilon`),
biases on every projection (`use_bias`), a plain GELU MLP (`c_fc`, GELU, `c_proj`; `gelu_pytorch_tanh` in the
released configs) and a sliding window in every layer (`sliding_window`, as Mistral's: model_config)."""

from __future__ import annotations

from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps
from .layers import LayerNorm
from .plain_mlp import PlainMLP


class Starcoder2Layer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, norm_eps(hf_config))


class Starcoder2ForCausalLM(DecoderLM):
    layer_class = Starcoder2Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "use_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("c_fc", "c_proj"), "StarCoder2", ("gelu", "gelu_pytorch_tanh"),
                        "gelu_pytorch_tanh", bias=bool(getattr(self.config, "use_bias", True)))
