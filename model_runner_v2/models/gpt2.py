"""GPT-2 (`GPT2LMHeadModel`: gpt2, gpt2-medium / large / xl, distilgpt2, and the models trained with its code), as
transformers computes it: learned absolute position embeddings added to the token embeddings (no rotary: every
layer's rotary is the identity, smollm3.without_rotary), GPT-NeoX's sequential layer (LayerNorms with biases
before attention and before the MLP), one query / key / value head each, biases everywhere, the plain MLP of width
`n_inner` (4 x hidden when null) with `activation_function` (gelu_new by default), a final LayerNorm, the head tied
to the embeddings. `scale_attn_weights` false drops the 1/sqrt(head_dim) scale; `scale_attn_by_inverse_layer_idx`
divides layer i's by i + 1; `reorder_and_upcast_attn` changes nothing here (the kernels score in fp32).

Checkpoints: transformers' Conv1D keeps its weights [in, out], so every projection is transposed at load; `c_attn`
holds q | k | v columns, split into q_proj / k_proj / v_proj. Names come with the `transformer.` prefix (a
transformers module, recent files) or without it (the original gpt2 files); the attention-mask buffers
(`attn.bias`, `attn.masked_bias`) are not weights."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLM, DecoderSpec, rename_first
from .gpt_neox import GPTNeoXLayer
from .layers import Embedding
from .plain_mlp import PlainMLP
from .smollm3 import without_rotary

_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
_RENAMES = ((re.compile(r"^(transformer\.)?wte\."), "model.embed_tokens."),
            (re.compile(r"^(transformer\.)?wpe\."), "model.embed_positions."),
            (re.compile(r"^(transformer\.)?ln_f\."), "model.norm."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.ln_1\."), r"model.layers.\2.input_layernorm."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.ln_2\."), r"model.layers.\2.post_attention_layernorm."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.c_proj\."), r"model.layers.\2.self_attn.o_proj."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.attn\.c_attn\."), r"model.layers.\2.self_attn.c_attn."),
            (re.compile(r"^(transformer\.)?h\.(\d+)\.mlp\."), r"model.layers.\2.mlp."))


class GPT2Layer(GPTNeoXLayer):
    parallel_by_default = False

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        scale = self.self_attn.attn.scale if getattr(hf_config, "scale_attn_weights", True) else 1.0
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.self_attn.attn.scale = scale


class GPT2LMHeadModel(DecoderLM):
    layer_class = GPT2Layer
    arch_label, default_activation = "GPT-2", "gelu_new"  # the name in errors; without activation_function

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.embed_positions = Embedding(hf_config.max_position_embeddings, hf_config.hidden_size)
        without_rotary(self.model.layers)  # absolute positions: nothing rotates

    def build_mlp(self, layer_idx: int) -> nn.Module:
        inner = getattr(self.config, "n_inner", None) or 4 * self.config.hidden_size
        return PlainMLP(self.config, ("c_fc", "c_proj"), self.arch_label, ("gelu_new", "gelu", "gelu_pytorch_tanh"),
                        self.default_activation, act_key="activation_function", intermediate_size=inner)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _IGNORED.match(name):
            return
        name = rename_first(name, _RENAMES)
        conv1d = name.endswith(".weight") and (".self_attn." in name or ".mlp." in name)
        if conv1d:  # Conv1D: [in, out] -> [out, in]
            tensor = tensor.t()
        prefix, _, rest = name.rpartition(".")
        if not prefix.endswith(".self_attn.c_attn"):
            yield name, tensor
            return
        owner = prefix[: -len(".c_attn")]
        for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):  # q | k | v rows
            yield f"{owner}.{part}.{rest}", piece
