"""XGLM (`XGLMForCausalLM`: Meta's xglm-564M ... 7.5B), as transformers computes it: OPT's fairseq decoder (opt.py:
pre-norm LayerNorms with biases at eps 1e-5, q / k / v / out projections and fc1 / fc2 with biases, positions at
offset 2, a final LayerNorm, the head tied to the embeddings) with

- fixed sinusoidal positions instead of learned ones (not in the checkpoint): row p + 2 of [sin(p f) | cos(p f)],
  f_i = exp(-i ln(10000) / (d / 2 - 1)), built in fp32 on the CPU and held in the model dtype as transformers does;
- the embeddings times sqrt(d_model) (`scale_embedding`);
- the exact (erf) GELU (`activation_function` "gelu"), width `ffn_dim`.
transformers scales q after its projection (rounded in the model dtype) and the scores not; the engine scales the
scores (the same in fp32; one rounding less in bf16). `add_cross_attention` (no released checkpoint) is refused."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import rename_first
from .opt import OPTForCausalLM
from .plain_mlp import PlainMLP

_RENAMES = ((re.compile(r"^model\.layer_norm\."), "model.norm."),
            (re.compile(r"^model\.layers\.(\d+)\.self_attn_layer_norm\."), r"model.layers.\1.input_layernorm."),
            (re.compile(r"^model\.layers\.(\d+)\.final_layer_norm\."), r"model.layers.\1.post_attention_layernorm."),
            (re.compile(r"^model\.layers\.(\d+)\.self_attn\.out_proj\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^model\.layers\.(\d+)\.(fc1|fc2)\."), r"model.layers.\1.mlp.\2."))
_IGNORED = re.compile(r"^model\.embed_positions\.")  # old fairseq exports' position buffers: not weights


class SinusoidalPositions(nn.Module):
    """positions [T] -> XGLM's fixed sinusoidal rows at position + 2 [T, d] (the model dtype)."""

    def __init__(self, num_positions: int, dim: int, padding_idx: int | None, offset: int = 2):
        super().__init__()
        self.offset = offset
        half = dim // 2
        freqs = torch.exp(torch.arange(half, dtype=torch.int64, device="cpu").float() * -(math.log(10000) / (half - 1)))
        angles = torch.arange(num_positions + offset, dtype=torch.int64, device="cpu").float()[:, None] * freqs[None]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        if dim % 2:
            table = torch.cat([table, torch.zeros(table.shape[0], 1)], dim=1)
        if padding_idx is not None:
            table[padding_idx] = 0
        # built on the CPU (the same bits everywhere), held where the model is built (its device context)
        self.register_buffer("table", table.to(torch.get_default_device(), torch.get_default_dtype()),
                             persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions + self.offset]


class XGLMForCausalLM(OPTForCausalLM):
    def __init__(self, hf_config):
        if getattr(hf_config, "add_cross_attention", False):
            raise ValueError("XGLM with add_cross_attention (an encoder's attention) is not supported")
        super().__init__(hf_config)
        self.model.embed_positions = SinusoidalPositions(hf_config.max_position_embeddings, hf_config.hidden_size,
                                                         getattr(hf_config, "pad_token_id", None))
        if getattr(hf_config, "scale_embedding", True):
            self.model.embed_scale = math.sqrt(hf_config.hidden_size)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("fc1", "fc2"), "XGLM", ("gelu", "relu", "gelu_new"), "gelu",
                        act_key="activation_function", intermediate_size=self.config.ffn_dim)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not _IGNORED.match(name):
            yield rename_first(name, _RENAMES), tensor
