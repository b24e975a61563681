"""K-EXAONE (`ExaoneMoeForCausalLM`, LG AI Research's EXAONE MoE), as transformers' ExaoneMoe computes it:

- Llama's pre-norm layers with EXAONE 4's attention: per-head q/k RMSNorms before the rotation, no biases; where the
  config names a `sliding_window`, a window in the layers `layer_types` calls sliding and no rotary in the others
  (EXAONE 4's "global NoPE": exaone4.global_nope);
- the layers `mlp_layer_types` calls sparse (transformers' config writes it from `first_k_dense_replace`) take
  DeepSeek-V3's block: the fp32 grouped sigmoid router with its correction bias (glm4_moe.Glm4MoeBlock),
  `num_experts` experts of `moe_intermediate_size`, renormalised, times `routed_scaling_factor`, plus
  `num_shared_experts` shared experts (one SwiGLU of moe_intermediate_size * that); the others a dense SwiGLU.

Checkpoints keep the router's correction bias beside the gate (`mlp.e_score_correction_bias`: renamed under
`mlp.gate`) and the multi-token-prediction module under `mtp.*` (skipped, as transformers skips it).

HY-V3 (`HYV3ForCausalLM`, Tencent's Hy3-preview): the same block (one group: a plain top-k of the corrected sigmoid
scores, renormalised, times `router_scaling_factor`) after a dense first layer (`mlp_layer_types`), under Qwen3's
attention (per-head q/k norms before the rope) in every layer; its MTP layers (`model.layers.<num_hidden_layers>.*`)
skipped. Hub names: `mlp.router.gate.weight` (the router), `mlp.expert_bias` (its correction), `mlp.shared_mlp.*`
(the shared expert), renamed at load. transformers adds the routed and shared outputs in fp32
(`enable_moe_fp32_combine`) then rounds once: what a 16-bit add computes too."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderMLP, DecoderSpec
from .exaone4 import Exaone4ForCausalLM, global_nope
from .glm4_moe import Glm4MoeBlock, Glm4MoeForCausalLM


class ExaoneMoeBlock(Glm4MoeBlock):
    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)  # GLM's `n_shared_experts` is absent: none built there
        width = int(hf_config.moe_intermediate_size) * int(getattr(hf_config, "num_shared_experts", 0) or 0)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width) if width else None


class ExaoneMoeForCausalLM(Glm4MoeForCausalLM):
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return Exaone4ForCausalLM.spec(hf_config)  # q/k norms per head, no biases, the whole head rotating

    def __init__(self, hf_config):
        super().__init__(hf_config)
        global_nope(self.model.layers, hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return ExaoneMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("mtp."):
            return ()
        name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super().checkpoint_parts(name, tensor)


_HYV3_NAMES = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.e_score_correction_bias"),
               (".mlp.shared_mlp.", ".mlp.shared_experts."))


class HYV3Block(ExaoneMoeBlock):
    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        self.scale = float(getattr(hf_config, "router_scaling_factor", 1.0) or 1.0)


class HYV3ForCausalLM(ExaoneMoeForCausalLM):
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias",
                                ".mlp.router.gate.weight", ".mlp.expert_bias")

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return HYV3Block(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for theirs, ours in _HYV3_NAMES:
            name = name.replace(theirs, ours)
        return super().checkpoint_parts(name, tensor)
