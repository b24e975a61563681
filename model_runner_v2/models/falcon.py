"""Falcon (`FalconForCausalLM`: Falcon-7B, Falcon-40B, Falcon-180B, Falcon2-11B), as transformers computes it: rotary
positions (rotate-half pairs over whole heads), a GELU MLP (`dense_h_to_4h`, `dense_4h_to_h`, width
`ffn_hidden_size`), biases where `bias` says, LayerNorms with biases, the head tied to the embeddings.

Three layer forms, out of the config:
- `parallel_attn` with one norm (Falcon-7B; Falcon2-11B's `new_decoder_architecture` with
  num_ln_in_parallel_attn 1): attention and the MLP read the same normed stream (Phi-2's layer, models/phi.py);
- `new_decoder_architecture` with two norms (Falcon-40B / 180B): `ln_attn` before attention, `ln_mlp` before the MLP,
  both over the same stream (GPT-NeoX's parallel layer, models/gpt_neox.py);
- neither: sequential (GPT-NeoX's `use_parallel_residual` false).
The output is HF's `(mlp + attn) + residual` in every parallel form (two-term sums: either order is the same bits).

The fused `query_key_value` rows: `new_decoder_architecture` groups them per KV head ([kv, (its q heads | k | v), D]);
`multi_query` (the 7B) holds every q head then one k and one v ([H | 1 | 1] x D); otherwise per head ([H, 3, D]).
ALiBi models (`alibi`: Falcon-RW) are refused: no kernel here adds position biases."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from ...model_config import attention_shape
from .decoder import DecoderLM, DecoderSpec, rename_first
from .gpt_neox import GPTNeoXLayer, qkv_pieces, split_per_head_qkv
from .phi import PhiLayer
from .plain_mlp import PlainMLP

_RENAMES = ((re.compile(r"^transformer\.word_embeddings\."), "model.embed_tokens."),
            (re.compile(r"^transformer\.ln_f\."), "model.norm."),
            (re.compile(r"^transformer\.h\.(\d+)\.ln_attn\."), r"model.layers.\1.input_layernorm."),
            (re.compile(r"^transformer\.h\.(\d+)\.ln_mlp\."), r"model.layers.\1.post_attention_layernorm."),
            (re.compile(r"^transformer\.h\.(\d+)\.self_attention\.dense\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^transformer\.h\.(\d+)\.self_attention\."), r"model.layers.\1.self_attn."),
            (re.compile(r"^transformer\.h\."), "model.layers."))


def _shared_norm(hf_config) -> bool:
    """One LayerNorm for attention and the MLP (parallel_attn, and not the new architecture's two norms)."""
    if not getattr(hf_config, "parallel_attn", True) and not getattr(hf_config, "new_decoder_architecture", False):
        return False
    if getattr(hf_config, "new_decoder_architecture", False):
        return (getattr(hf_config, "num_ln_in_parallel_attn", None) or 2) == 1
    return True


class FalconLayer(GPTNeoXLayer):
    """GPT-NeoX's layer (two norms, parallel or sequential), or Phi-2's where one norm serves both sub-blocks."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.parallel = bool(getattr(hf_config, "parallel_attn", True)
                             or getattr(hf_config, "new_decoder_architecture", False))
        self.shared = _shared_norm(hf_config)
        if self.shared:
            self.post_attention_layernorm = None  # HF's checkpoints carry no second norm

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shared:
            return PhiLayer.forward(self, positions, x, residual)
        return super().forward(positions, x, residual)


class FalconForCausalLM(DecoderLM):
    layer_class = FalconLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        if getattr(hf_config, "alibi", False):
            raise ValueError("Falcon with alibi=true (ALiBi position biases: Falcon-RW) is not supported")
        bias = bool(getattr(hf_config, "bias", False))
        # K/V heads from multi_query / new_decoder_architecture (a transformers 4.x config names no num_key_value_heads)
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, qk_norm=False,
                           num_kv_heads=attention_shape("FalconForCausalLM", hf_config)[0])

    def build_mlp(self, layer_idx: int) -> nn.Module:
        inner = getattr(self.config, "ffn_hidden_size", None) or 4 * self.config.hidden_size
        return PlainMLP(self.config, ("dense_h_to_4h", "dense_4h_to_h"), "Falcon", ("gelu",), "gelu",
                        bias=bool(getattr(self.config, "bias", False)), act_key="activation", intermediate_size=inner)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield from qkv_pieces(rename_first(name, _RENAMES), tensor, ".query_key_value",
                              lambda fused: self._split(name, fused))

    def _split(self, name: str, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        heads, kv = cfg.num_attention_heads, attention_shape("FalconForCausalLM", cfg)[0]
        head_dim = cfg.hidden_size // heads
        rest = fused.shape[1:]
        if getattr(cfg, "new_decoder_architecture", False):  # [kv, (heads / kv q heads | k | v), D]
            grouped = fused.reshape(kv, heads // kv + 2, head_dim, *rest)
            return (grouped[:, :-2].reshape(heads * head_dim, *rest), grouped[:, -2].reshape(kv * head_dim, *rest),
                    grouped[:, -1].reshape(kv * head_dim, *rest))
        if kv == 1:  # multi_query: [H x D | D | D]
            return fused.split([heads * head_dim, head_dim, head_dim], dim=0)
        return split_per_head_qkv(name, fused, heads)  # [H, (q | k | v), D]
