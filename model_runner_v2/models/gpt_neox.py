"""GPT-NeoX causal LM (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B, and the models trained with its code): LayerNorms
with biases (layers.LayerNorm), a rotary over the first quarter of each head (`rotary_pct` / partial_rotary_factor
0.25 by default), biases on the attention projections (`attention_bias`) and a plain GELU MLP (`dense_h_to_4h`,
GELU, `dense_4h_to_h`, both with biases).

A layer (HF's GPTNeoXLayer) normalises its input twice: input_layernorm for attention, post_attention_layernorm for
the MLP. With `use_parallel_residual` (the default; Pythia) both read the same stream: out = (mlp(ln2(x)) +
attn(ln1(x))) + x, HF's order; the layer returns (mlp + attn, x) and the next norm adds them. Without it:
h = attn(ln1(x)) + x, out = mlp(ln2(h)) + h.

Checkpoint names differ from the other architectures' (`gpt_neox.embed_in`, `attention.query_key_value`,
`attention.dense`, `gpt_neox.final_layer_norm`, `embed_out`): `checkpoint_parts` renames them, and splits the fused
query_key_value, whose rows are grouped per head ([heads, (q | k | v), head_size]), into q, k and v."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec, norm_eps, rename_first
from .layers import LayerNorm
from .plain_mlp import PlainMLP

# Old checkpoints' attention mask and rotary buffers: not weights.
_IGNORED = re.compile(r".*\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")
_RENAMES = ((re.compile(r"^gpt_neox\.embed_in\."), "model.embed_tokens."),
            (re.compile(r"^gpt_neox\.final_layer_norm\."), "model.norm."),
            (re.compile(r"^embed_out\."), "lm_head."),
            (re.compile(r"^gpt_neox\.layers\.(\d+)\.attention\.dense\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^gpt_neox\.layers\."), "model.layers."))


class GPTNeoXLayer(DecoderLayer):
    parallel_by_default = True  # without `use_parallel_residual` in the config (GPT-2's layer: sequential)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.parallel = bool(getattr(hf_config, "use_parallel_residual", self.parallel_by_default))

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, norm_eps(hf_config))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, stream = self.self_attn(positions, x, residual, self.input_layernorm)  # stream: x (+ residual)
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(stream)) + attn, stream
        h, stream = self.post_attention_layernorm.add_and_norm(attn, stream)  # stream: attn + x
        return self.mlp(h), stream


class GPTNeoXForCausalLM(DecoderLM):
    layer_class = GPTNeoXLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        kv_heads = getattr(hf_config, "num_key_value_heads", None)
        if kv_heads not in (None, hf_config.num_attention_heads):
            raise ValueError(f"GPT-NeoX attention has a key/value head per query head; config.json's "
                             f"num_key_value_heads={kv_heads} (transformers ignores it) would size the cache wrong")
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=True, qk_norm=False, partial_rotary_factor=0.25)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("dense_h_to_4h", "dense_4h_to_h"), "GPT-NeoX",
                        ("gelu", "gelu_pytorch_tanh"), "gelu")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _IGNORED.match(name):
            return
        heads = self.config.num_attention_heads
        yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".attention.query_key_value",
                              lambda fused: split_per_head_qkv(name, fused, heads), into=".self_attn")


def qkv_pieces(name: str, tensor: torch.Tensor, fused: str, split, into: str = ""
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """A (renamed) checkpoint tensor as the decoder's: itself, unless it is a fused q|k|v weight or bias (a name
    `<owner><fused>.weight|bias`), which `split` ([rows, ...] -> q, k, v) cuts into `<owner><into>.q_proj.<...>`,
    k_proj and v_proj (GPT-NeoX's query_key_value, GPT-BigCode's c_attn, Falcon's query_key_value)."""
    prefix, _, rest = name.rpartition(".")  # rest: weight / bias
    if not prefix.endswith(fused):
        yield name, tensor
        return
    owner = prefix[: -len(fused)] + into
    for part, piece in zip(("q_proj", "k_proj", "v_proj"), split(tensor)):
        yield f"{owner}.{part}.{rest}", piece


def split_per_head_qkv(name: str, tensor: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """A fused q|k|v weight or bias whose rows are grouped per head ([heads * 3 * D, ...] as [heads, (q | k | v),
    D]) -> q, k and v, each [heads * D, ...] in head order (GPT-NeoX's query_key_value, GPT-BigCode's c_attn
    without multi_query)."""
    if tensor.shape[0] % (3 * heads):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, not 3 x {heads} heads' worth")
    grouped = tensor.reshape(heads, 3, tensor.shape[0] // (3 * heads), *tensor.shape[1:])
    return tuple(grouped[:, i].reshape(-1, *tensor.shape[1:]) for i in range(3))
