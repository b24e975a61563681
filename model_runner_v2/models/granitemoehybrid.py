"""Granite MoE with a shared MLP (`GraniteMoeSharedForCausalLM`) and Granite 4.0's attention-only form
(`GraniteMoeHybridForCausalLM`: granite-4.0-micro and other configs whose every layer is attention).

- GraniteMoeShared: Granite MoE's layers (granitemoe.py) whose sparse block adds a dense SwiGLU of width
  `shared_intermediate_size` that every token runs, ungated: out = routed(x) + shared(x), as transformers'
  GraniteMoeSharedMoE computes it (no shared MLP where that width is 0).
- GraniteMoeHybrid: the same layers where `num_local_experts` > 0; with no experts each layer's MLP is the shared MLP
  alone (a dense SwiGLU of `shared_intermediate_size`: granite-4.0-micro). The attention rotates by rope only where
  `position_embedding_type` is "rope" (NoPE otherwise). The hybrid checkpoints (granite-4.0-h-*: "mamba" /
  "linear_attention" in `layer_types`) put a Mamba-2 mixer (mamba2.py, a recurrent state per request:
  docs/hybrid_models.md) in those layers' place of the attention.

Weights: `model.layers.N.shared_mlp.input_linear.weight` [2I, H] holds the gate rows then the up rows (transformers
chunks its output in two: act(first) * second): split into the two parts of a fused gate_up_proj (each rank takes
its share of both under tensor parallelism), `shared_mlp.output_linear.weight` is its down_proj."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...hybrid_facts import layer_types
from .decoder import DecoderMLP, DecoderSpec
from .granitemoe import GraniteMoeForCausalLM, GraniteMoeLayer
from .layers import RotaryEmbedding
from .mamba2 import Mamba2Mixer
from .moe import TopLogitsMoeBlock
from .qwen2_moe import Qwen2MoeForCausalLM
from .smollm3 import without_rotary


class GraniteSharedMoeBlock(TopLogitsMoeBlock):
    """Granite MoE's routed experts plus the shared MLP (none where shared_intermediate_size is 0)."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        width = int(getattr(hf_config, "shared_intermediate_size", 0) or 0)
        self.shared_expert = DecoderMLP(hf_config, spec, intermediate_size=width) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)
        if self.shared_expert is None:
            return routed
        return routed + self.shared_expert.down(self.shared_expert.gate_up_proj(x))


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM, Qwen2MoeForCausalLM):
    """Granite MoE's scalars, router and expert names; Qwen2-MoE's loading of a shared expert's gate and up parts."""

    shared_mlp_name = "shared_expert"  # where layer N's shared MLP lives, after model.layers.N.mlp

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return GraniteSharedMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3] == "shared_mlp":
            prefix = ".".join(["model", "layers", parts[2], "mlp", self.shared_mlp_name] if self.shared_mlp_name
                              else ["model", "layers", parts[2], "mlp"])
            if parts[4:] == ["input_linear", "weight"]:
                if tensor.shape[0] % 2:
                    raise ValueError(f"checkpoint tensor {name!r}: an odd number of rows {tensor.shape[0]} "
                                     "(gate rows then up rows)")
                gate, up = tensor.chunk(2, dim=0)
                return ((f"{prefix}.gate_proj.weight", gate), (f"{prefix}.up_proj.weight", up))
            if parts[4:] == ["output_linear", "weight"]:
                return ((f"{prefix}.down_proj.weight", tensor),)
        return super().checkpoint_parts(name, tensor)


class GraniteHybridLayer(GraniteMoeLayer):
    """A Granite 4.0 layer: attention (its Attention's layer_idx the attention layers' count before it: the Mamba
    layers have no KV cache) or a Mamba-2 mixer (`mamba`, mamba2.py) where `layer_types` says so; then the layer's
    MLP. Both sub-blocks' outputs times residual_multiplier, as Granite's."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        kinds = layer_types(hf_config)
        if kinds[layer_idx] == "full_attention":
            super().__init__(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary, mlp)
            self.mamba = None
            return
        nn.Module.__init__(self)
        self.mamba = Mamba2Mixer(hf_config)
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)
        self.residual_multiplier = float(hf_config.residual_multiplier)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mamba is None:
            return super().forward(positions, x, residual)
        m = self.residual_multiplier
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.mamba(x) * m
        if isinstance(self.mlp, DecoderMLP):
            x, residual = self.mlp(x, residual, self.post_attention_layernorm)
            return x * m, residual
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x) * m, residual


class GraniteMoeHybridForCausalLM(GraniteMoeSharedForCausalLM):
    layer_class = GraniteHybridLayer

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        if not getattr(hf_config, "shared_intermediate_size", 0):
            raise ValueError("config.json: GraniteMoeHybrid needs shared_intermediate_size > 0")
        self.dense = not int(getattr(hf_config, "num_local_experts", 0) or 0)
        if self.dense:
            self.shared_mlp_name = ""  # the layer's MLP itself
        super().__init__(hf_config)
        kind = getattr(hf_config, "position_embedding_type", None)
        if kind not in (None, "rope", "nope"):
            raise ValueError(f"config.json: position_embedding_type {kind!r} is not supported (None or 'rope')")
        if kind != "rope":
            without_rotary(layer for layer in self.model.layers if layer.mamba is None)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        if self.dense:
            return DecoderMLP(self.config, self.spec(self.config),
                              intermediate_size=int(self.config.shared_intermediate_size))
        return super().build_mlp(layer_idx)
