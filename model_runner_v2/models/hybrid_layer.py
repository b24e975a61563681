"""HybridLayer: a pre-norm decoder layer whose first sub-block is attention or a linear layer with a recurrent state
(recurrent_layer.py), as the config's layer kinds say (hybrid_facts.layer_types), then the layer's MLP: LFM2's
short-convolution layers (lfm2.py), Bamba's Mamba-2 layers (bamba.py), Jamba's Mamba-1 layers (jamba.py). Llama's
layer otherwise: the norms, the deferred residual adds, the dense MLP's fused norm."""

from __future__ import annotations

import torch
from torch import nn

from ...hybrid_facts import layer_types
from .decoder import DecoderLayer, DecoderMLP, DecoderSpec
from .layers import RotaryEmbedding

# Jamba's checkpoint names, which Bamba and Falcon-H1 keep: the MLP `feed_forward`, the norm before it
# `pre_ff_layernorm`, the final norm `model.final_layernorm`
_FEED_FORWARD_NAMES = {"feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm"}


def feed_forward_names(name: str) -> str:
    """A Jamba-style checkpoint name as the decoder's."""
    if name == "model.final_layernorm.weight":
        return "model.norm.weight"
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["model", "layers"]:
        parts[3] = _FEED_FORWARD_NAMES.get(parts[3], parts[3])
    return ".".join(parts)


def pre_norm_block(norm: nn.Module, block: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """block(norm(x [+ residual])) and the new residual (x itself on the first layer): a pre-norm sub-block with
    the previous one's residual add deferred into its norm."""
    if residual is None:
        return block(norm(x)), x
    h, residual = norm.add_and_norm(x, residual)
    return block(h), residual


class HybridLayer(DecoderLayer):
    """An attention layer (its Attention's layer_idx: the attention layers before it, the linear ones having no KV
    cache) or, in the layers the config calls linear, `linear_class(hf_config)` under the attribute `linear_name`
    (the checkpoints' name for it: no self_attn there)."""

    linear_name = "mamba"
    linear_class: type[nn.Module] = nn.Module

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        kinds = layer_types(hf_config)
        self.linear = kinds[layer_idx] != "full_attention"
        if not self.linear:
            super().__init__(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary, mlp)
            return
        nn.Module.__init__(self)
        setattr(self, self.linear_name, self.linear_class(hf_config))
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.linear:
            return super().forward(positions, x, residual)
        # a module call: forward hooks see the block's output
        x, residual = pre_norm_block(self.input_layernorm, getattr(self, self.linear_name), x, residual)
        if isinstance(self.mlp, DecoderMLP):
            return self.mlp(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual
