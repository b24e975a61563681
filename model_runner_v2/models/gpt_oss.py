"""GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b / gpt-oss-120b), as transformers' GptOss computes it:

- attention with q/k/v/o biases and an attention sink per q head (`self_attn.sinks`: one more logit in every
  softmax's denominator, attached to no value; Attention.enable_sinks, in every attention path); a 128-token
  sliding window in the layers `layer_types` calls sliding (every other one); YaRN rope (`truncate: false`);
- RMSNorms that multiply the weight into the fp32 row before the cast (OLMo 2's order: weight_in_fp32);
- a sparse MoE block in every layer: a router with a bias, the top-k logits and a softmax over those k
  (moe.route_top_logits); experts with biases and the clamped SwiGLU (u + 1) * g * sigmoid(1.702 g)
  (kernels/activation.ClampedSwiGLU).

Weights (transformers' names): `mlp.router.{weight,bias}` is our router `mlp.gate`; `self_attn.sinks` the
attention's `self_attn.attn.sinks`. The experts are stacked and stored transposed, gate and up interleaved:
`mlp.experts.gate_up_proj` [E, H, 2I] (column 2i gate i, 2i + 1 up i), `gate_up_proj_bias` [E, 2I] the same way,
`down_proj` [E, I, H], `down_proj_bias` [E, H]: `checkpoint_parts` turns them into StackedExperts' layout (gate rows
then up rows [E, 2I, H]; [E, H, I]). openai's checkpoints store the two expert matrices in MXFP4 (quantization_config
mxfp4; `gate_up_proj_blocks` / `_scales` [E, 2I, H / 32, 16] / [E, 2I, H / 32], their rows interleaved gate / up,
`down_proj_*` [E, H, I / 32, ...]): each pair is dequantized exactly to the model dtype once both halves are read
(quantization/mxfp4.py), then laid out as above. Any other quantization_config is refused
(model_config.check_checkpoint_quantization)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import ClampedSwiGLU
from ...model_config import check_checkpoint_quantization
from ..quantization.mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX, dequantize_mxfp4
from .decoder import DecoderAttention, DecoderLayer, DecoderSpec
from .layers import RotaryEmbedding
from .moe import TopLogitsMoeBlock
from .parallel import get_tp_state, mark_sharded
from .qwen3_moe import Qwen3MoeForCausalLM


class GptOssAttention(DecoderAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.attn.enable_sinks()  # this rank's heads' sinks
        mark_sharded(self.attn.sinks, 0, get_tp_state(), hf_config.num_attention_heads)


class GptOssLayer(DecoderLayer):
    attention_class = GptOssAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.input_layernorm.weight_in_fp32 = True
        self.post_attention_layernorm.weight_in_fp32 = True


def deinterleave(tensor: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate i at column 2i and up i at 2i + 1 -> [..., 2I] gate columns then up columns."""
    return torch.cat((tensor[..., 0::2], tensor[..., 1::2]), dim=-1)


class GptOssForCausalLM(Qwen3MoeForCausalLM):
    layer_class = GptOssLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False)

    def __init__(self, hf_config):
        check_checkpoint_quantization(type(self).__name__, hf_config)  # MXFP4 only
        super().__init__(hf_config)
        self.model.norm.weight_in_fp32 = True
        self._mxfp4_halves: dict[str, torch.Tensor] = {}  # an MXFP4 weight's first-read half, until its other one

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        act = ClampedSwiGLU(float(getattr(self.config, "swiglu_alpha", 1.702)),
                            float(getattr(self.config, "swiglu_limit", 7.0)))
        return TopLogitsMoeBlock(self.config, layer_idx, facts, router_bias=True, expert_bias=True, clamped=act)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if parts[-2:] == ["self_attn", "sinks"]:
            return ((".".join(parts[:-1] + ["attn", "sinks"]), tensor),)
        if len(parts) > 2 and parts[-3:-1] == ["mlp", "router"]:
            return ((".".join(parts[:-2] + ["gate", parts[-1]]), tensor),)
        if len(parts) > 2 and parts[-3:-1] == ["mlp", "experts"]:
            kind = parts[-1]
            if kind.endswith((BLOCKS_SUFFIX, SCALES_SUFFIX)):
                return self._mxfp4_part(name, tensor)
            if kind == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H], gate rows then up rows
                tensor = deinterleave(tensor).transpose(1, 2)
            elif kind == "gate_up_proj_bias":  # [E, 2I] interleaved -> [E * 2I]
                tensor = deinterleave(tensor).reshape(-1)
            elif kind == "down_proj":  # [E, I, H] -> [E, H, I]
                tensor = tensor.transpose(1, 2)
            elif kind == "down_proj_bias":  # [E, H] -> [E * H]
                tensor = tensor.reshape(-1)
        return ((name, tensor),)

    def _mxfp4_part(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """One half of an MXFP4 expert weight: kept until the other half comes (a checkpoint may store them in
        different files), then the dequantized weight in transformers' layout, through checkpoint_parts. A weight
        whose other half never comes is reported missing by load_weights."""
        base, half = name[:-len(BLOCKS_SUFFIX)], name[-len(BLOCKS_SUFFIX):]  # both suffixes are 7 characters
        other = self._mxfp4_halves.pop(base + (SCALES_SUFFIX if half == BLOCKS_SUFFIX else BLOCKS_SUFFIX), None)
        if other is None:
            self._mxfp4_halves[name] = tensor
            return ()
        blocks, scales = (tensor, other) if half == BLOCKS_SUFFIX else (other, tensor)
        like = self.model.embed_tokens.weight  # the model's dtype and device: on a GPU the lookups run there
        try:
            weight = dequantize_mxfp4(blocks.to(like.device), scales.to(like.device), like.dtype)  # [E, rows, in]
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        return self.checkpoint_parts(base, weight.transpose(1, 2))  # transformers' [E, in, out]
