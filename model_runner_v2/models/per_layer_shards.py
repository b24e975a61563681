"""Fused projections whose rows differ between layers (Gemma 4's full layers' own head dim and KV heads, its KV-shared
layers' q alone, MLP widths per layer; MiMo-V2-Flash's sliding layers' twice the KV heads and its narrower V): a
checkpoint's q / k / v and gate / up tensors placed by their own layer's parts, not by the first layer's
(DecoderLM._fused_shards)."""

from __future__ import annotations

from torch import nn

from .decoder import DecoderMLP

_QKV = ("q_proj", "k_proj", "v_proj")


class PerLayerShards:
    """DecoderLM mixin (listed before DecoderLM's subclass in the bases)."""

    def layer_shards(self, layer: int) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (fused name, first row, rows) in layer `layer`'s qkv_proj (its parts in q, k, v
        order: as many as it has) and gate_up_proj; this rank's rows."""
        block, shards, offset = self.model.layers[layer], {}, 0
        qkv = getattr(block.self_attn, "qkv_proj", None)
        for name, rows in zip(_QKV, qkv.part_sizes if qkv is not None else ()):
            shards[name] = ("qkv_proj", offset, rows)
            offset += rows
        if isinstance(getattr(block, "mlp", None), DecoderMLP):
            inter = block.mlp.intermediate_size
            shards.update(gate_proj=("gate_up_proj", 0, inter), up_proj=("gate_up_proj", inter, inter))
        return shards

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        return self.layer_shards(0)  # (every layer's tensor is placed by its own layer's: weight_target)

    def weight_target(self, name: str, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int] | None:
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            shards = self.layer_shards(int(parts[2]))
        elif len(parts) >= 2 and parts[-2] in (*_QKV, "gate_proj", "up_proj"):
            raise ValueError(f"tensor {name!r} matches no parameter of {type(self).__name__}")
        return super().weight_target(name, params, shards)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)  # (a shared expert's own gate | up rows: Qwen2-MoE's)
        for name in params:
            parts = name.split(".")
            # the layer's own attention's qkv_proj and dense MLP's gate_up_proj (model.layers.N.self_attn.qkv_proj.*)
            if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[3:5] in (["self_attn", "qkv_proj"],
                                                                                     ["mlp", "gate_up_proj"]):
                offsets = {off for f, off, _ in self.layer_shards(int(parts[2])).values() if f == parts[4]}
                pieces[name] = offsets or {0}
        return pieces
