"""Phi-1.5 / Phi-2 (`PhiForCausalLM`): one LayerNorm a layer whose output both attention and the MLP read, their
outputs added to the residual stream together (HF's `attn + mlp + residual`, in that order: the layer returns
(attn + mlp, stream) and the next norm adds the two); biases on q/k/v and the output projection (`dense`); a rotary
over the first `partial_rotary_factor` of each head (0.4 in the released configs); a plain MLP (`fc1`, `gelu_new`,
`fc2`, with biases); a final LayerNorm (`final_layernorm`) and an LM head with a bias. Per-head q/k LayerNorms
(`qk_layernorm`) are refused."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps
from .layers import LayerNorm
from .plain_mlp import PlainMLP
from .stablelm import NORMED

_RENAMES = ((re.compile(r"^model\.final_layernorm\."), "model.norm."),
            (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."))


class PhiLayer(DecoderLayer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.post_attention_layernorm = None  # one norm a layer (HF's checkpoints carry no other)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, norm_eps(hf_config))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = x if residual is None else x + residual  # the deferred add, HF's `(attn + mlp) + residual`
        normed = self.input_layernorm(stream)
        attn, _ = self.self_attn(positions, normed, None, NORMED)
        return attn + self.mlp(normed), stream


class PhiForCausalLM(DecoderLM):
    layer_class = PhiLayer
    lm_head_bias = True

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        if getattr(hf_config, "qk_layernorm", False):
            raise ValueError("Phi's per-head q/k LayerNorms (qk_layernorm: true) are not supported")
        return DecoderSpec(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False, partial_rotary_factor=0.5)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("fc1", "fc2"), "Phi", ("gelu_new",), "gelu_new")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for pattern, new in _RENAMES:
            name = pattern.sub(new, name)
        yield name, tensor
