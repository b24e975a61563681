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

import dataclasses
from collections.abc import Iterator

import torch

from ...model_config import attention_shape
from .decoder import DecoderSpec, rename_first
from .gpt2 import _IGNORED, _RENAMES, GPT2LMHeadModel
from .gpt_neox import qkv_pieces, split_per_head_qkv


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    arch_label, default_activation = "GPT-BigCode", "gelu_pytorch_tanh"  # its config class's default

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        # K/V heads from multi_query (a transformers 4.x config names no num_key_value_heads): 1 or H
        return dataclasses.replace(super().spec(hf_config),
                                   num_kv_heads=attention_shape("GPTBigCodeForCausalLM", hf_config)[0])

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not _IGNORED.match(name):
            yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".c_attn",
                                  lambda fused: self._split(name, fused))

    def _split(self, name: str, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads = self.config.num_attention_heads
        head_dim = self.config.hidden_size // heads
        if attention_shape("GPTBigCodeForCausalLM", self.config)[0] == 1:  # [H x D | D | D] rows
            return fused.split([heads * head_dim, head_dim, head_dim], dim=0)
        return split_per_head_qkv(name, fused, heads)  # [H, (q | k | v), D] rows grouped per head
