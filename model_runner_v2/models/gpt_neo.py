"""GPT-Neo (`GPTNeoForCausalLM`: EleutherAI's gpt-neo-125m / 1.3B / 2.7B), as transformers computes it: GPT-2's model
(gpt2.py: learned absolute positions, LayerNorms before attention and the MLP, the plain `c_fc` / `c_proj` MLP with
biases, gelu_new, a final LayerNorm, the head tied to the embeddings) with separate q / k / v projections without
bias (`out_proj` biased), scores *not* scaled by 1/sqrt(head_dim) (in fp32, as every attention path here scores),
and in the layers `attention_layers` calls "local" a window of `window_size` keys (a query at p sees p - W + 1 .. p:
the sliding window's rule; model_config reads it).

Checkpoints: `nn.Linear` weights under `transformer.h.N.attn.attention.{q,k,v,out}_proj`; the mask buffers older
files stored (`attn.attention.bias`, `masked_bias`) are not weights."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderSpec, rename_first
from .gpt2 import _RENAMES, GPT2Layer, GPT2LMHeadModel
from .plain_mlp import PlainMLP

_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.attention\.(bias|masked_bias)$")
_ATTENTION = ((re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.attention\.out_proj\."),
               r"model.layers.\2.self_attn.o_proj."),
              (re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.attention\."), r"model.layers.\2.self_attn."))


class GPTNeoLayer(GPT2Layer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.self_attn.attn.scale = 1.0  # GPT-Neo scores q . k unscaled


class GPTNeoForCausalLM(GPT2LMHeadModel):
    layer_class = GPTNeoLayer
    arch_label, default_activation = "GPT-Neo", "gelu_new"

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=True, mlp_bias=True, qk_norm=False)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        inner = getattr(self.config, "intermediate_size", None) or 4 * self.config.hidden_size
        return PlainMLP(self.config, ("c_fc", "c_proj"), self.arch_label, ("gelu_new", "gelu", "gelu_pytorch_tanh",
                                                                          "relu"),
                        self.default_activation, act_key="activation_function", intermediate_size=inner)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not _IGNORED.match(name):
            yield rename_first(rename_first(name, _ATTENTION), _RENAMES), tensor
