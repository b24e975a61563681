"""GPT-BigCode (`GPTBigCodeForCausalLM`: StarCoder / StarCoderBase, SantaCoder, WizardCoder, OctoCoder, Granite
20B / 34B Code), as transformers computes it: GPT-2's layer (models/gpt2.py: learned absolute positions, LayerNorms
with biases before attention and before the MLP, the plain MLP of width `n_inner`, `activation_function`
gelu_pytorch_tanh by default, a final LayerNorm, the head tied to the embeddings), with multi-query attention by
default (`multi_query`: one key / value head for every query head; false: one per query head).

Checkpoints: `nn.Linear` weights ([out, in]: none transposed, unlike GPT-2's Conv1D). The fused `c_attn` holds, with
`multi_query`, the query rows of every head, then one head's key rows, then its value rows ([H x D | D | D]);
without it, its rows grouped per head ([H, (q | k | v), D], GPT-NeoX's layout). Names come with the `transformer.`
prefix; `lm_head.weight`, when stored, is the tied embedding."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from ...model_config import attention_shape
from .decoder import DecoderSpec, rename_first
from .gpt2 import _RENAMES, GPT2LMHeadModel
from .gpt_neox import split_per_head_qkv

_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        # what the attention layers read (transformers 4.x's config has no num_key_value_heads): 1 or H
        hf_config.num_key_value_heads = attention_shape("GPTBigCodeForCausalLM", hf_config)[0]
        return super().spec(hf_config)

    def build_mlp(self, layer_idx: int):
        if getattr(self.config, "activation_function", None) is None:  # a config.json without it: the class default
            self.config.activation_function = "gelu_pytorch_tanh"
        return super().build_mlp(layer_idx)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _IGNORED.match(name):
            return
        name = rename_first(name, _RENAMES)
        prefix, _, rest = name.rpartition(".")  # rest: weight / bias
        if not prefix.endswith(".self_attn.c_attn"):
            yield name, tensor
            return
        owner = prefix[: -len(".c_attn")]
        heads = self.config.num_attention_heads
        head_dim = self.config.hidden_size // heads
        if self.config.num_key_value_heads == 1:  # [H x D | D | D] rows
            parts = tensor.split([heads * head_dim, head_dim, head_dim], dim=0)
        else:  # [H, (q | k | v), D] rows grouped per head
            parts = split_per_head_qkv(name, tensor, heads)
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), parts):
            yield f"{owner}.{part}.{rest}", piece
