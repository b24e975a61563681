"""BLOOM (`BloomForCausalLM`: bloom-560m / 1b1 / 1b7 / 3b / 7b1 / 176B, bloomz, mt0-free BLOOM fine-tunes), as
transformers computes it: no rotary and no position embeddings but ALiBi (each attention score plus a fixed slope
per head times the key's distance, `Attention.enable_alibi`: the slopes transformers' `_get_alibi_slopes` makes, a
geometric series per power-of-two block of heads), a LayerNorm on the embeddings (`word_embeddings_layernorm`),
GPT-NeoX's sequential layer (LayerNorms with biases before attention and before the MLP, biases on every
projection), the plain MLP of width 4 x hidden with BLOOM's tanh GELU, a final LayerNorm and the head tied to the
embeddings.

Checkpoints: the fused `query_key_value` rows are grouped per head ([heads, (q | k | v), head_dim], GPT-NeoX's
layout); names come with the `transformer.` prefix or without it (the original BigScience files). Refused, never
run as something else: `apply_residual_connection_post_layernorm` (the residual taken after the norm) and
`slow_but_exact` with `pretraining_tp` > 1 (the output projections summed in slices)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLM, DecoderSpec, rename_first
from .gpt_neox import GPTNeoXLayer, qkv_pieces, split_per_head_qkv
from .layers import LayerNorm
from .parallel import get_tp_state
from .plain_mlp import PlainMLP
from .smollm3 import without_rotary

_RENAMES = ((re.compile(r"^(transformer\.)?word_embeddings\."), "model.embed_tokens."),
            (re.compile(r"^(transformer\.)?word_embeddings_layernorm\."), "model.embed_norm."),
            (re.compile(r"^(transformer\.)?ln_f\."), "model.norm."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.self_attention\.dense\."), r"model.layers.\2.self_attn.o_proj."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.self_attention\."), r"model.layers.\2.self_attn."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\."), r"model.layers.\2."))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's slope of each head [num_heads] fp32, as transformers' BLOOM computes them: for the largest power of
    two n <= num_heads, base^1 .. base^n with base = 2^(-8 / n); the remaining heads take every other power of the
    series for 2n heads."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, torch.pow(extra, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))])
    return slopes


def use_alibi(layers: nn.ModuleList, slopes: torch.Tensor) -> None:
    """ALiBi instead of any rotation in every layer: each attention takes this tensor-parallel rank's share of
    `slopes` (one per q head of the model; its heads are split in order, as the projections')."""
    without_rotary(layers)
    tp = get_tp_state()
    for layer in layers:
        layer.self_attn.attn.enable_alibi(slopes.chunk(tp.size)[tp.rank])


class BloomLayer(GPTNeoXLayer):
    parallel_by_default = False  # BLOOM's layer is sequential (its configs name no use_parallel_residual)


class BloomForCausalLM(DecoderLM):
    layer_class = BloomLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False)

    def __init__(self, hf_config):
        problems = [what for what, bad in (
            ("its residual is taken after the layer norm (apply_residual_connection_post_layernorm true)",
             getattr(hf_config, "apply_residual_connection_post_layernorm", False)),
            ("its output projections are summed in pretraining_tp slices (slow_but_exact true)",
             getattr(hf_config, "slow_but_exact", False) and getattr(hf_config, "pretraining_tp", 1) > 1)) if bad]
        if problems:
            raise ValueError(f"this BLOOM checkpoint is not supported: {'; '.join(problems)}")
        super().__init__(hf_config)
        self.model.embed_norm = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_epsilon)
        use_alibi(self.model.layers, alibi_slopes(hf_config.num_attention_heads))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("dense_h_to_4h", "dense_4h_to_h"), "BLOOM", ("bloom_gelu",), "bloom_gelu",
                        intermediate_size=4 * self.config.hidden_size)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        heads = self.config.num_attention_heads
        yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".self_attn.query_key_value",
                              lambda fused: split_per_head_qkv(name, fused, heads), into=".self_attn")
