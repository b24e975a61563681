"""MPT (`MptForCausalLM`, and the hub checkpoints' `MPTForCausalLM`: MPT-7B / 30B and their instruct, chat and
storywriter fine-tunes), as transformers computes it: ALiBi instead of positions (MPT's slopes: 2^(-8 i / n) for the
next power of two n of the heads, every other one first when the count is not a power of two;
`attn_config.alibi_bias_max` the 8), LayerNorms with a weight and no bias, GPT-NeoX's sequential layer, no bias on any
projection, the fused `Wqkv` ([q | k | v] rows) clamped at `attn_config.clip_qkv`, `attn_config.softmax_scale` (or
1 / sqrt(head_dim)), an exact-GELU MLP 4 x wide, the head tied to the embeddings.

Refused, never run as something else (transformers' port does not run them either): learned positions instead of
ALiBi (`attn_config.alibi` false), per-head q/k LayerNorms (`qk_ln`), prefix-LM attention, biases (`no_bias` false),
an MLP other than 4 x wide (`expansion_ratio`)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from .bloom import use_alibi
from .decoder import DecoderLM, DecoderSpec, rename_first
from .gpt_neox import GPTNeoXLayer, qkv_pieces
from .layers import LayerNorm
from .plain_mlp import PlainMLP

_RENAMES = ((re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
            (re.compile(r"^transformer\.norm_f\."), "model.norm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.norm_1\."), r"model.layers.\1.input_layernorm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.norm_2\."), r"model.layers.\1.post_attention_layernorm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.attn\.out_proj\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.attn\."), r"model.layers.\1.self_attn."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.ffn\."), r"model.layers.\1.mlp."))


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float = 8.0) -> torch.Tensor:
    """MPT's ALiBi slope per head [num_heads] fp32, as transformers' `build_mpt_alibi_tensor` makes them."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, padded + 1, dtype=torch.int64).float() * (alibi_bias_max / padded)
    slopes = 1.0 / torch.pow(2, base)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def nested_attn_config(hf_config, key: str, default=None):
    """A key of the nested `attn_config` (MPT's, DBRX's: a config object under transformers, a dict in raw JSON)."""
    attn = getattr(hf_config, "attn_config", None)
    value = attn.get(key, default) if isinstance(attn, dict) else getattr(attn, key, default)
    return default if value is None else value


class MptLayer(GPTNeoXLayer):
    parallel_by_default = False  # MPT's block is sequential

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon, bias=False)


class MptForCausalLM(DecoderLM):
    layer_class = MptLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        clip = nested_attn_config(hf_config, "clip_qkv")
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                           num_kv_heads=hf_config.num_attention_heads, clip_qkv=float(clip) if clip else None)

    def __init__(self, hf_config):
        problems = [what for what, bad in (
            ("learned positions, not ALiBi (attn_config.alibi false)",
             not nested_attn_config(hf_config, "alibi", True)),
            ("per-head q/k LayerNorms (attn_config.qk_ln)", nested_attn_config(hf_config, "qk_ln", False)),
            ("prefix-LM attention (attn_config.prefix_lm)", nested_attn_config(hf_config, "prefix_lm", False)),
            ("biases (no_bias false)", not getattr(hf_config, "no_bias", True)),
            (f"an MLP {getattr(hf_config, 'expansion_ratio', 4)} x wide (expansion_ratio; 4 is supported)",
             getattr(hf_config, "expansion_ratio", 4) != 4)) if bad]
        if problems:
            raise ValueError(f"this MPT checkpoint is not supported: {'; '.join(problems)}")
        super().__init__(hf_config)
        use_alibi(self.model.layers, mpt_alibi_slopes(hf_config.num_attention_heads,
                                                      float(nested_attn_config(hf_config, "alibi_bias_max", 8))))
        scale = nested_attn_config(hf_config, "softmax_scale")
        if scale:
            for layer in self.model.layers:
                layer.self_attn.attn.scale = float(scale)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("up_proj", "down_proj"), "MPT", ("gelu",), "gelu", bias=False,
                        intermediate_size=4 * self.config.hidden_size)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".self_attn.Wqkv",
                              lambda fused: fused.chunk(3, dim=0), into=".self_attn")  # [q | k | v] rows


class MPTForCausalLM(MptForCausalLM):
    """The name the hub's MPT checkpoints carry (mosaicml's remote code), the same model."""
