"""OpenAI GPT (`OpenAIGPTLMHeadModel`: openai-gpt, GPT-1; `OpenAIGPTDoubleHeadsModel`'s LM head too), as transformers'
OpenAIGPT computes it: GPT-2's learned absolute positions, Conv1D projections (q | k | v columns in `c_attn`), biases
everywhere and plain MLP (gpt2.py), in **post-norm** layers with no final norm:

    n = ln_1(x + attn(x));  h = ln_2(n + mlp(n))          (LayerNorms with biases, eps `layer_norm_epsilon`)

`afn` "gelu" is transformers' gelu_new (the tanh form); "relu", "silu" / "swish" as named. The head is tied to the
token embeddings. Checkpoints name the embeddings `tokens_embed` / `positions_embed` under `transformer.` (or
without it); the attention's mask buffer (`attn.bias`) is not a weight."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import DecoderSpec, rename_first
from .gpt2 import GPT2Layer, GPT2LMHeadModel
from .layers import LayerNorm
from .plain_mlp import ACTIVATIONS

_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.bias$")
_RENAMES = ((re.compile(r"^(transformer\.)?tokens_embed\."), "model.embed_tokens."),
            (re.compile(r"^(transformer\.)?positions_embed\."), "model.embed_positions."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.(ln_1|ln_2)\."), r"model.layers.\2.\3."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.c_proj\."), r"model.layers.\2.self_attn.o_proj."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.c_attn\."), r"model.layers.\2.self_attn.c_attn."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.mlp\."), r"model.layers.\2.mlp."))
_ACTS = {"gelu": "gelu_new", "relu": "relu"}  # afn -> ACTIVATIONS' name (silu / swish: F.silu)


class NoNorm(nn.Module):
    """A norm slot that normalises nothing: the attention reads the raw stream (no input norm), and the model has no
    final norm (its last layer's ln_2 output is the head's input). The layers pass no residual (None)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def norm_then(self, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module,
                  first: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(x), x

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return (x, x) if residual is None else (x + residual, x + residual)

    def add_and_norm_fp32(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return x.float() if residual is None else x.float() + residual.float()


class OpenAIGPTLayer(GPT2Layer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return NoNorm()

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        eps = float(getattr(hf_config, "layer_norm_epsilon", 1e-5))  # transformers' only eps here
        self.ln_1, self.ln_2 = LayerNorm(hf_config.hidden_size, eps), LayerNorm(hf_config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, None]:
        attn, _ = self.self_attn(positions, x, None, self.input_layernorm)  # on the raw stream
        n, _ = self.ln_1.add_and_norm(attn, x)  # ln_1(x + attn)
        h, _ = self.ln_2.add_and_norm(self.mlp(n), n)  # ln_2(n + mlp(n))
        return h, None


class OpenAIGPTLMHeadModel(GPT2LMHeadModel):
    layer_class = OpenAIGPTLayer
    arch_label, default_activation = "OpenAI GPT", "gelu"

    def build_mlp(self, layer_idx: int) -> nn.Module:
        afn = getattr(self.config, "afn", None) or "gelu"
        if afn not in (*_ACTS, "silu", "swish"):
            raise ValueError(f"afn {afn!r} is not supported for OpenAI GPT (supported: gelu, relu, silu, swish)")
        mlp = super().build_mlp(layer_idx)
        mlp.act = F.silu if afn in ("silu", "swish") else ACTIVATIONS[_ACTS[afn]]
        return mlp

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _IGNORED.match(name):
            return
        name = rename_first(name, _RENAMES)
        yield from super().checkpoint_parts(name, tensor)  # (the names are ours now: its Conv1D transposes, c_attn)


class OpenAIGPTDoubleHeadsModel(OpenAIGPTLMHeadModel):
    """The double-heads checkpoints: the LM head served; the multiple-choice head's `multiple_choice_head.*`
    skipped."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not name.startswith("multiple_choice_head."):
            yield from super().checkpoint_parts(name, tensor)
