"""StableLM causal LM (`StableLmForCausalLM`: StableLM-3B-4E1T, StableLM-2-1.6B, StableLM Zephyr): Llama's
attention (a q/k/v bias with `use_qkv_bias`) and SwiGLU MLP under LayerNorms with biases (layers.LayerNorm, HF's
nn.LayerNorm), a rotary over the first quarter of each head (`partial_rotary_factor` 0.25 by default).

With `use_parallel_residual` (StableLM-2-12B's layout) attention and MLP read the same normed input and both add
to the residual stream: out = x + attn(ln(x)) + mlp(ln(x)), HF's `(residual + attn) + mlp` in that order (the MLP's
output is the deferred add). StableLM-2-12B's per-head q/k LayerNorms (`qk_layernorm`: head_norm.py): transformers
keeps one nn.LayerNorm(head_dim) per head (`q_layernorm.norms.<h>.weight`); `checkpoint_parts` stacks a layer's
heads into one [heads, head_dim] weight once all of them are read."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderMLP, DecoderSpec
from .head_norm import HeadNormAttention
from .layers import LayerNorm, RotaryEmbedding

_HEAD_NORMS = ("q_layernorm", "k_layernorm")


class StableLmAttention(HeadNormAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        names = _HEAD_NORMS if getattr(hf_config, "qk_layernorm", False) else None
        super().__init__(hf_config, spec, layer_idx, rotary, names, hf_config.layer_norm_eps)


class StableLmLayer(DecoderLayer):
    attention_class = StableLmAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.parallel = bool(getattr(hf_config, "use_parallel_residual", False))
        if self.parallel:  # HF's parallel layer has no post_attention_layernorm (its checkpoints carry none)
            self.post_attention_layernorm = None

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.parallel:
            return super().forward(positions, x, residual)
        stream = x if residual is None else x + residual  # the deferred add, HF's `residual + h`
        normed = self.input_layernorm(stream)  # attention and MLP read the same normed stream: normed once
        attn, _ = self.self_attn(positions, normed, None, NORMED)
        return self.mlp(normed), stream + attn


class _Normed:
    """The `norm` a DecoderAttention takes, for an input already normed: the projection alone."""

    @staticmethod
    def norm_then(x: torch.Tensor, residual: None, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return layer(x), x


NORMED = _Normed()  # shared with phi.py


class ParallelMLP(DecoderMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] normed -> [T, H]
        return self.down(self.gate_up_proj(x))


class StableLmForCausalLM(DecoderLM):
    layer_class = StableLmLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "use_qkv_bias", False)), o_bias=False, mlp_bias=False,
                           qk_norm=False, partial_rotary_factor=0.25)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self._head_norm_rows: dict[str, dict[int, torch.Tensor]] = {}  # a per-head norm's heads read so far

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # model.layers.N.self_attn.q_layernorm.norms.<h>.weight [D] -> ...q_layernorm.weight [heads, D], all heads
        parts = name.split(".")
        if len(parts) > 4 and parts[-4] in _HEAD_NORMS and parts[-3] == "norms" and parts[-2].isdigit():
            target = ".".join(parts[:-3] + ["weight"])
            heads = self.config.num_attention_heads if parts[-4] == "q_layernorm" else (
                getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
            if int(parts[-2]) >= heads:
                raise ValueError(f"checkpoint tensor {name!r}: head {parts[-2]} >= the {heads} heads")
            rows = self._head_norm_rows.setdefault(target, {})
            rows[int(parts[-2])] = tensor
            if len(rows) < heads:
                return ()  # load_weights reports the weight missing if a head never comes
            del self._head_norm_rows[target]
            return ((target, torch.stack([rows[h] for h in range(heads)])),)
        return ((name, tensor),)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        spec = self.spec(self.config)
        if getattr(self.config, "use_parallel_residual", False):
            return ParallelMLP(self.config, spec)
        return DecoderMLP(self.config, spec)
