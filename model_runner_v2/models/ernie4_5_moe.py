"""Ernie 4.5 MoE (`Ernie4_5_MoeForCausalLM`: ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B), as transformers' Ernie4_5_Moe
computes it: Ernie 4.5's attention (biases when `use_bias`, the whole head rotating in interleaved pairs in fp32:
ernie4_5.py) in Llama's pre-norm layers; layer i is sparse when (i + 1) % `moe_layer_interval` == 0 and
`moe_layer_start_index` <= i <= `moe_layer_end_index` (-1: the last), else a dense SwiGLU of `intermediate_size`.

The sparse block: the router (`mlp.gate.weight`, fp32) scores the fp32 token, softmax over all experts; the top
`moe_k` of softmax + `e_score_correction_bias` are chosen and weighted by their softmax alone, renormalised by their
sum clamped at `moe_norm_min`, rounded to the model dtype; `moe_num_experts` experts of `moe_intermediate_size`, plus
`moe_num_shared_experts` shared ones (one SwiGLU of that many widths, biased when `use_bias`) every token runs. The LM
head is biased when `use_bias` too (the dense Ernie 4.5's is not).

Checkpoints keep the correction as `mlp.moe_statics.e_score_correction_bias` [1, E] (renamed under `mlp.gate`,
flattened) and the multi-token-prediction layers under `mtp*` (skipped, as transformers skips them)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...moe_facts import ernie_text_width
from .decoder import DecoderMLP, DecoderSpec
from .ernie4_5 import Ernie4_5ForCausalLM
from .glm4_moe import GroupedSigmoidRouter
from .moe import SparseMoeBlock
from .qwen2_moe import Qwen2MoeForCausalLM


def route_corrected_softmax(logits: torch.Tensor, correction: torch.Tensor, top_k: int, norm_min: float,
                            forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64), transformers' Ernie4_5_MoeTopKRouter op for op.
    forced [T, k] int16 (routing replay): rows with ids >= 0 take them, weighted alike."""
    probs = torch.softmax(logits, dim=1, dtype=torch.float32)
    ids = torch.topk(probs + correction, top_k, dim=-1).indices
    if forced is not None:
        ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
    weights = probs.gather(-1, ids)
    return weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=norm_min), ids


class Ernie4_5_MoeBlock(SparseMoeBlock):
    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.gate = GroupedSigmoidRouter(facts["num_experts"], hf_config.hidden_size)  # fp32 weight + correction
        self.norm_min = float(getattr(hf_config, "moe_norm_min", 1e-12))
        width = ernie_text_width(hf_config) * int(getattr(hf_config, "moe_num_shared_experts", 0) or 0)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width) if width else None

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_corrected_softmax(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.norm_min,
                                       forced)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts.down(self.shared_experts.gate_up_proj(x))


class Ernie4_5_MoeForCausalLM(Qwen2MoeForCausalLM):  # Qwen2-MoE's loading of shared experts' gate and up parts
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".e_score_correction_bias")

    def __init__(self, hf_config):
        self.lm_head_bias = bool(getattr(hf_config, "use_bias", False))  # the MoE model's head is biased with the rest
        super().__init__(hf_config)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return Ernie4_5ForCausalLM.spec(hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Ernie4_5_MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("mtp") or name.startswith("model.mtp"):
            return ()
        if getattr(self.config, "model_type", None) == "ernie4_5_vl_moe_text":
            name, tensor = _vl_text_part(name, tensor, int(self.config.moe_num_experts))
            if name is None:
                return ()
        if name.endswith("e_score_correction_bias"):  # [1, E] under mlp.moe_statics (or mlp.gate.moe_statics)
            name = name.replace(".gate.moe_statics.", ".gate.").replace(".moe_statics.", ".gate.")
            tensor = tensor.reshape(-1)
        return super().checkpoint_parts(name, tensor)


def _vl_text_part(name: str, tensor: torch.Tensor, experts: int) -> tuple[str | None, torch.Tensor]:
    """An ERNIE-4.5-VL tensor as the text model's (None: the vision experts' and router's). Its hub files hold 2E
    experts, the first E the text ones, the routers as [H, E] (`gate.weight` text, `gate.weight_1` vision) and both
    corrections as [2, E] rows; transformers' modules call them `mlp.text_moe.*` / `mlp.vision_moe.*`."""
    if ".mlp.vision_moe." in name or name.endswith(".mlp.gate.weight_1"):
        return None, tensor
    if ".mlp.text_moe." in name:
        return name.replace(".mlp.text_moe.", ".mlp."), tensor
    parts = name.split(".")
    if ".mlp.experts." in name and parts[parts.index("experts") + 1].isdigit():
        return (name, tensor) if int(parts[parts.index("experts") + 1]) < experts else (None, tensor)
    if name.endswith(".mlp.gate.weight") and tensor.dim() == 2 and tensor.shape[1] == experts:
        return name, tensor.t()  # [H, E] -> [E, H]
    if name.endswith(".mlp.moe_statics.e_score_correction_bias") and tensor.dim() == 2 and tensor.shape[0] == 2:
        return name, tensor[:1]  # the text row
    return name, tensor
