"""StableLM causal LM (`StableLmForCausalLM`: StableLM-3B-4E1T, StableLM-2-1.6B, StableLM Zephyr): Llama's
attention (a q/k/v bias with `use_qkv_bias`) and SwiGLU MLP under LayerNorms with biases (layers.LayerNorm, HF's
nn.LayerNorm), a rotary over the first quarter of each head (`partial_rotary_factor` 0.25 by default).

With `use_parallel_residual` (StableLM-2-12B's layout) attention and MLP read the same normed input and both add
to the residual stream: out = x + attn(ln(x)) + mlp(ln(x)), HF's `(residual + attn) + mlp` in that order (the MLP's
output is the deferred add). StableLM-2-12B's per-head q/k LayerNorms (`qk_layernorm`) are refused."""

from __future__ import annotations

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderMLP, DecoderSpec
from .layers import LayerNorm


class StableLmLayer(DecoderLayer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        eps = hf_config.layer_norm_eps
        self.input_layernorm = LayerNorm(hf_config.hidden_size, eps)
        self.parallel = bool(getattr(hf_config, "use_parallel_residual", False))
        # HF's parallel layer has no post_attention_layernorm (its checkpoints carry none)
        self.post_attention_layernorm = None if self.parallel else LayerNorm(hf_config.hidden_size, eps)

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
        if getattr(hf_config, "qk_layernorm", False):
            raise ValueError("StableLM's per-head q/k LayerNorms (qk_layernorm: true, StableLM-2-12B) are not "
                             "supported")
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "use_qkv_bias", False)), o_bias=False, mlp_bias=False,
                           qk_norm=False, partial_rotary_factor=0.25)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.norm = LayerNorm(hf_config.hidden_size, hf_config.layer_norm_eps)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        spec = self.spec(self.config)
        if getattr(self.config, "use_parallel_residual", False):
            return ParallelMLP(self.config, spec)
        return DecoderMLP(self.config, spec)
