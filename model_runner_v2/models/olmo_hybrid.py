"""OLMo Hybrid (`OlmoHybridForCausalLM`: AI2's Olmo-Hybrid), as transformers computes it: Gated DeltaNet layers
(gated_deltanet.py: a recurrent state per request, docs/hybrid_models.md) beside OLMo 2's attention layers, as
`layer_types` says, every RMSNorm in OLMo 2's order (the weight times the fp32 row, then cast):
- a linear layer is pre-norm: x + linear_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.));
  its delta rule's beta is 2 sigmoid(b) where `linear_allow_neg_eigval` (the default), its gated output norm's eps
  1e-5 whatever `rms_norm_eps` says;
- an attention layer is OLMo 2's (olmo2.py): post-norms after the attention and the MLP, q / k norms over whole
  projections; no rotary where the config's rope_theta is null (the released checkpoints), else the whole head in
  fp32 with fp32 tables.
Weights: the linear layer's separate `q_proj` / `k_proj` / `v_proj` / `g_proj` (the output gate) / `b_proj` /
`a_proj` load as the parts of its one in_proj, `o_norm` / `o_proj` as its norm / out_proj; the checkpoints' norm names
`attention_layer_norm` / `feedforward_layer_norm` as input_layernorm / post_attention_layernorm; the convolution
split in three (`q_conv1d`, `k_conv1d`, `v_conv1d`: transformers' save) is concatenated back; `mtp.*` skipped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...hybrid_facts import layer_types
from .decoder import DecoderSpec
from .gated_deltanet import GatedDeltaNet
from .hybrid_layer import pre_norm_block
from .layers import RotaryEmbedding
from .olmo2 import Olmo2ForCausalLM, Olmo2Layer
from .smollm3 import without_rotary

_LINEAR_NAMES = {"q_proj": "in_proj_q", "k_proj": "in_proj_k", "v_proj": "in_proj_v", "g_proj": "in_proj_z",
                 "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_norm": "norm", "o_proj": "out_proj"}
_NORM_NAMES = {"attention_layer_norm": "input_layernorm", "feedforward_layer_norm": "post_attention_layernorm"}
_CONV_PARTS = ("q_conv1d", "k_conv1d", "v_conv1d")


class OlmoHybridDeltaNet(GatedDeltaNet):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.beta_scale = 2.0 if getattr(hf_config, "linear_allow_neg_eigval", True) else 1.0
        self.norm.eps = 1e-5  # transformers' OlmoHybridGatedDeltaNet fixes it


class OlmoHybridLayer(Olmo2Layer):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        kinds = layer_types(hf_config)
        self.linear = kinds[layer_idx] == "linear_attention"
        if not self.linear:  # its KV cache: the attention layers' count before it
            super().__init__(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary, mlp)
            return
        nn.Module.__init__(self)
        self.linear_attn = OlmoHybridDeltaNet(hf_config)
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.linear:
            return super().forward(positions, x, residual)
        h, residual = pre_norm_block(self.input_layernorm, self.linear_attn, x, residual)
        return pre_norm_block(self.post_attention_layernorm, self.mlp, h, residual)


class OlmoHybridForCausalLM(Olmo2ForCausalLM):
    layer_class = OlmoHybridLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, rope_fp32=True, rope_fp32_tables=True)

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)
        params = getattr(hf_config, "rope_parameters", None)
        if not params or params.get("rope_theta") is None:  # transformers builds no rotary then (NoPE)
            without_rotary(layer for layer in self.model.layers if not layer.linear)
        self._conv_parts: dict[str, dict[str, torch.Tensor]] = {}  # a layer's split convolution, until whole

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        shards = super()._fused_shards()
        linear = next((layer.linear_attn for layer in self.model.layers if layer.linear), None)
        if linear is not None:
            shards.update(linear.in_proj_shards())
        return shards

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.startswith("mtp."):
            return
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            parts[3] = _NORM_NAMES.get(parts[3], parts[3])
            if parts[3] == "linear_attn":
                if parts[4] in _CONV_PARTS:  # q | k | v in order make the convolution's weight (any cut of it)
                    prefix = ".".join(parts[:4])
                    pending = self._conv_parts.setdefault(prefix, {})
                    pending[parts[4]] = tensor
                    if len(pending) == len(_CONV_PARTS):
                        del self._conv_parts[prefix]
                        yield f"{prefix}.conv1d.weight", torch.cat([pending[p] for p in _CONV_PARTS])
                    return
                parts[4] = _LINEAR_NAMES.get(parts[4], parts[4])
        yield ".".join(parts), tensor
