"""Apertus (`ApertusForCausalLM`: swiss-ai's Apertus-8B / 70B), as transformers computes it: Llama's layers (llama3
rope) with Qwen3's per-head q/k RMSNorms before rope, the layer norms named `attention_layernorm` /
`feedforward_layernorm`, and an ungated MLP down_proj(xIELU(up_proj(x))).

xIELU (transformers' XIELUActivation, its Python form, op for op in the model dtype): per layer two learned scalars
`alpha_p`, `alpha_n` and two fixed ones `beta` (0.5), `eps` (-1e-6):
    a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n)
    x > 0:  a_p x^2 + beta x;   x <= 0:  (expm1(min(x, eps)) - x) a_n + beta x
`beta` and `eps` are buffers transformers saves; a checkpoint without them keeps the defaults."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .decoder import DecoderSpec
from .language_model import language_model_parts
from .llama import LlamaForCausalLM
from .parallel import ColumnParallelLinear, RowParallelLinear, lm_head
from .plain_mlp import ACTIVATIONS, PlainMLP

_FIXED = (".act_fn.beta", ".act_fn.eps")  # scalars a checkpoint may omit (transformers' defaults then)
_NORM_NAMES = {"attention_layernorm": "input_layernorm", "feedforward_layernorm": "post_attention_layernorm"}


class XIELU(nn.Module):
    def __init__(self, beta: float = 0.5, eps: float = -1e-6):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.empty(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor([beta]), requires_grad=False)  # [1]: the loader writes rows
        self.eps = nn.Parameter(torch.tensor([eps]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, I]
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class XieluMLP(nn.Module):
    """x [T, H] (normed) -> down_proj(xIELU(up_proj(x))) [T, H] (transformers' ApertusMLP)."""

    def __init__(self, hf_config):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hf_config.hidden_size, [hf_config.intermediate_size], bias=False)
        self.down_proj = RowParallelLinear(hf_config.intermediate_size, hf_config.hidden_size, bias=False)
        self.act_fn = XIELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if (getattr(self.config, "hidden_act", None) or "xielu") == "xielu":
            return XieluMLP(self.config)
        return PlainMLP(self.config, ("up_proj", "down_proj"), "Apertus", ("xielu", *ACTIVATIONS), "xielu",
                        bias=False)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] in _NORM_NAMES:
            parts[3] = _NORM_NAMES[parts[3]]
        if name.endswith(_FIXED):
            tensor = tensor.reshape(1)  # transformers' 0-d buffers
        return ((".".join(parts), tensor),)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)
        for name in [n for n in pieces if n.endswith(_FIXED)]:
            del pieces[name]  # optional in a checkpoint
        return pieces


_APERTUS1P5_SKIPPED = ("model.vision_tokenizer.", "model.audio_tokenizer.")  # the code tokenizers: not the LM


class Apertus1p5TextForCausalLM(ApertusForCausalLM):
    """Apertus 1.5 (swiss-ai's Apertus-v1.5: early-fusion multimodal, its images and audio already token ids when
    they reach the language model): Apertus's layers exactly, with an LM head of `output_vocab_size` rows (the text
    tokens) under an embedding of `vocab_size` (text and codes): the logits' width is the former
    (ModelConfig.vocab_size), a prompt may hold ids up to the latter. The multimodal checkpoint's language-model
    tensors are renamed, its vision / audio tokenizers' skipped."""

    def __init__(self, hf_config):
        super().__init__(hf_config)
        out = getattr(hf_config, "output_vocab_size", None)
        if out is not None and out != hf_config.vocab_size:
            if self.tie_word_embeddings:
                raise ValueError(f"Apertus 1.5: tie_word_embeddings with output_vocab_size={out} != vocab_size="
                                 f"{hf_config.vocab_size} (a tied head has the embedding's rows)")
            self.lm_head = lm_head(hf_config.hidden_size, int(out))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith(_APERTUS1P5_SKIPPED):
            return ()
        parts = super().checkpoint_parts  # (zero-argument super() is unbound inside a comprehension)
        return [part for text in language_model_parts(name, tensor) for part in parts(*text)]


class Apertus1p5ForConditionalGeneration(Apertus1p5TextForCausalLM):
    """The released multimodal files (`text_config`, model_config.TEXT_OF_MULTIMODAL), served as their language
    model: text (and code ids) in, text out."""
