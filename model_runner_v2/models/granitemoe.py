"""Granite MoE (`GraniteMoeForCausalLM`: granite-3.0 / 3.1 -1b-a400m and -3b-a800m): Granite's layers and four
scalars (granite.py) with a sparse block in every layer: a router whose k largest logits are softmaxed in fp32
(moe.TopLogitsMoeBlock, as transformers' GraniteMoeTopKRouter) and `num_local_experts` SwiGLU experts of
`intermediate_size` (moe.StackedExperts).

Weights: the hub's checkpoints keep each layer's experts stacked as `block_sparse_moe.input_linear.weight`
[E, 2I, H] (gate rows then up rows per expert, our layout) and `block_sparse_moe.output_linear.weight` [E, H, I],
its router as `block_sparse_moe.router.layer.weight`; transformers 5 names them `block_sparse_moe.experts.
{gate_up_proj, down_proj}` and `block_sparse_moe.router.weight`. Both map onto `mlp.experts.*` and `mlp.gate`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .decoder import DecoderMLP
from .granite import GraniteForCausalLM, GraniteLayer
from .moe import TopLogitsMoeBlock
from .qwen3_moe import Qwen3MoeForCausalLM

# the block's tensor names (after `model.layers.N.block_sparse_moe.`) -> ours (after `model.layers.N.mlp.`)
_NAMES = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
          "router.layer.weight": "gate.weight", "experts.gate_up_proj": "experts.gate_up_proj",
          "experts.down_proj": "experts.down_proj", "router.weight": "gate.weight"}


class GraniteMoeLayer(GraniteLayer):
    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.mlp, DecoderMLP):  # Granite 4.0's dense layers (granitemoehybrid.py): Granite's
            return super().forward(positions, x, residual)
        m = self.residual_multiplier
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x * m, residual)
        return self.mlp(x) * m, residual


class GraniteMoeForCausalLM(GraniteForCausalLM, Qwen3MoeForCausalLM):  # Granite's scalars, Qwen3-MoE's expert loading
    layer_class = GraniteMoeLayer

    def sparse_block(self, layer_idx: int, facts: dict) -> TopLogitsMoeBlock:
        return TopLogitsMoeBlock(self.config, layer_idx, facts)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".", 4)  # model, layers, N, block_sparse_moe, rest
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] == "block_sparse_moe":
            rest = _NAMES.get(parts[4])
            if rest is None:
                raise ValueError(f"tensor {name!r} matches no parameter of {type(self).__name__}")
            name = f"model.layers.{parts[2]}.mlp.{rest}"
        return ((name, tensor),)
