"""OPT (`OPTForCausalLM`: facebook/opt-125m, 1.3b, 2.7b, 6.7b, 13b, 30b, 66b), as transformers computes it: learned
absolute positions looked up at position + 2 (OPT's offset) and added to the token embeddings, no rotary (an
identity one), GPT-NeoX's sequential pre-norm layer (LayerNorms with biases, eps 1e-5: torch's default, which OPT
keeps), q / k / v / out projections and the fc1 -> ReLU -> fc2 MLP with biases (`enable_bias`), a final LayerNorm
and the head tied to the embeddings.

opt-350m's form is refused, never run as something else: its layers norm after the residual add
(`do_layer_norm_before` false) and its embeddings are narrower than the layers (`word_embed_proj_dim`, project_in /
project_out)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLM, DecoderSpec, rename_first
from .gpt2 import GPT2Layer
from .layers import Embedding, LayerNorm
from .plain_mlp import PlainMLP
from .smollm3 import without_rotary

OPT_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default: OPT's config names none
# checkpoints name the stack `model.decoder.*`, or `decoder.*` (files saved from OPTModel, the original release)
_LAYER = r"^(?:model\.)?decoder\.layers\.(\d+)\."
_RENAMES = ((re.compile(r"^(?:model\.)?decoder\.final_layer_norm\."), "model.norm."),
            (re.compile(_LAYER + r"self_attn_layer_norm\."), r"model.layers.\1.input_layernorm."),
            (re.compile(_LAYER + r"final_layer_norm\."), r"model.layers.\1.post_attention_layernorm."),
            (re.compile(_LAYER + r"self_attn\.out_proj\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(_LAYER + r"(fc1|fc2)\."), r"model.layers.\1.mlp.\2."),
            (re.compile(r"^(?:model\.)?decoder\."), "model."))


class OffsetEmbedding(Embedding):
    """OPT's learned positions: row position + offset of a [max_position_embeddings + offset, H] table."""

    def __init__(self, num_positions: int, dim: int, offset: int = 2):
        super().__init__(num_positions + offset, dim)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions + self.offset)


class OPTLayer(GPT2Layer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, OPT_LAYER_NORM_EPS)


class OPTForCausalLM(DecoderLM):
    layer_class = OPTLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "enable_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False)

    def __init__(self, hf_config):
        problems = [what for what, bad in (
            ("its layers norm after the residual add (do_layer_norm_before false)",
             not getattr(hf_config, "do_layer_norm_before", True)),
            ("its embeddings are projected (word_embed_proj_dim != hidden_size)",
             getattr(hf_config, "word_embed_proj_dim", hf_config.hidden_size) != hf_config.hidden_size),
            ("its LayerNorms have no weights (layer_norm_elementwise_affine false)",
             not getattr(hf_config, "layer_norm_elementwise_affine", True)),
            ("it has no final LayerNorm (_remove_final_layer_norm)", getattr(hf_config, "_remove_final_layer_norm",
                                                                               False))) if bad]
        if problems:
            raise ValueError(f"this OPT checkpoint (opt-350m's form) is not supported: {'; '.join(problems)}")
        super().__init__(hf_config)
        self.model.embed_positions = OffsetEmbedding(hf_config.max_position_embeddings, hf_config.hidden_size)
        without_rotary(self.model.layers)  # absolute positions: nothing rotates

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("fc1", "fc2"), "OPT", ("relu",), "relu", bias=self.spec(self.config).mlp_bias,
                        act_key="activation_function", intermediate_size=self.config.ffn_dim)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        name = rename_first(name, _RENAMES)
        yield name, tensor
