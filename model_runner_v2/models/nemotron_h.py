"""NemotronH (`NemotronHForCausalLM`: Nemotron-H 4B / 8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B / 12B-v2): every layer
one mixer after one RMSNorm (the weight times the fp32 row, then cast: OLMo 2's order) and a residual add, the mixer
by the layer's kind: Mamba-2 ("M", mamba2.py: a recurrent state per request, docs/hybrid_models.md), attention without
a rotary ("*", NoPE, head_dim^-0.5), or an ungated ReLU² MLP ("-"). The kinds come from `layers_block_type`
(transformers >= 5.25) or the checkpoints' `hybrid_override_pattern`. MoE layers ("E": Nemotron 3 Nano) are refused.

Checkpoints name the model `backbone` (`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`,
`backbone.norm_f`); transformers' module names it `model`: both are read as the decoder's names (a layer's
`mixer` as its `self_attn`, `mamba` or `mlp` by kind; the multi-token-prediction layers `mtp.*` skipped)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...hybrid_facts import ATTENTION_KINDS, layer_types
from .decoder import DecoderAttention, DecoderLM, DecoderSpec
from .layers import RMSNorm, RotaryEmbedding
from .mamba2 import Mamba2Mixer
from .plain_mlp import PlainMLP
from .smollm3 import without_rotary

_KINDS = (*ATTENTION_KINDS, "mlp", "moe")
_MIXER_NAME = {"full_attention": "self_attn", "linear_attention": "mamba", "mlp": "mlp"}


class NemotronHLayer(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module | None):
        super().__init__()
        kinds = layer_types(hf_config, _KINDS)
        self.kind = kinds[layer_idx]
        self.input_layernorm = self.make_norm(hf_config)
        if self.kind == "full_attention":  # its KV cache: the attention layers' count before it
            self.self_attn = DecoderAttention(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary)
        elif self.kind == "linear_attention":
            self.mamba = Mamba2Mixer(hf_config)
        else:
            self.mlp = mlp

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, float(hf_config.layer_norm_epsilon), weight_in_fp32=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "full_attention":
            return self.self_attn(positions, x, residual, self.input_layernorm)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        return (self.mamba(h) if self.kind == "linear_attention" else self.mlp(h)), residual


class NemotronHForCausalLM(DecoderLM):
    layer_class = NemotronHLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)

    def __init__(self, hf_config):
        self.kinds = layer_types(hf_config, _KINDS)
        if "moe" in self.kinds:
            raise ValueError("NemotronH with MoE layers ('E' in hybrid_override_pattern: Nemotron 3 Nano) is not "
                             "supported yet; its Mamba-2 ('M'), attention ('*') and MLP ('-') layers are")
        if getattr(hf_config, "sliding_window", None):
            raise ValueError("NemotronH with a sliding_window is not supported")
        super().__init__(hf_config)
        without_rotary(layer for layer in self.model.layers if layer.kind == "full_attention")

    def build_mlp(self, layer_idx: int) -> nn.Module | None:
        if self.kinds[layer_idx] != "mlp":
            return None
        return PlainMLP(self.config, ("up_proj", "down_proj"), "NemotronH", ("relu2",), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", False)), act_key="mlp_hidden_act")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.startswith("mtp."):
            return  # the multi-token-prediction layers: not served
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = {"model.embeddings.weight": "model.embed_tokens.weight",
                "model.norm_f.weight": "model.norm.weight"}.get(name, name)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            kind = self.kinds[int(parts[2])] if int(parts[2]) < len(self.kinds) else None
            if parts[3] == "norm":
                parts[3] = "input_layernorm"
            elif parts[3] == "mixer" and kind in _MIXER_NAME:
                parts[3] = _MIXER_NAME[kind]
            name = ".".join(parts)
        yield name, tensor
