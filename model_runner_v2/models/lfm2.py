"""LFM2 (`Lfm2ForCausalLM`: Liquid AI's LFM2-350M / 700M / 1.2B / 2.6B) and LFM2-MoE (`Lfm2MoeForCausalLM`:
LFM2-8B-A1B), as transformers computes them.

Pre-norm layers (Llama's RMSNorm, eps `norm_eps`): an operator after `operator_norm`, then a SwiGLU feed-forward
after `ffn_norm`, each added to the residual. The operator by `layer_types` ("conv" / "full_attention"; older configs:
`full_attn_idxs`, the others conv):
- attention: Llama's (no biases, rotate-half rope over the whole head) with per-head RMSNorms of q and k before the
  rotation (`q_layernorm`, `k_layernorm`), its output projection named `out_proj`;
- a gated short convolution (`conv`, ShortConv): in_proj -> B | C | x (hidden wide each); the causal depthwise
  convolution of width `conv_L_cache` over B * x (no activation); C times it; out_proj. Its state per request is the
  last conv_L_cache - 1 values of B * x (recurrent_layer.py, docs/hybrid_models.md), no recurrent matrix.
The final norm is named `embedding_norm` (applied after the last layer, not to the embeddings); the head is tied.

The feed-forward (w1 gate, w3 up, w2 down) of LFM2 is `intermediate_size` wide (`block_ff_dim` in the hub's
config, which transformers' config class reads as it) adjusted as transformers does when `block_auto_adjust_ff_dim`:
int(2 I / 3), times `block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of` (LFM2-1.2B: 12288 ->
8192). LFM2-MoE: dense layers below `num_dense_layers` (`intermediate_size` as is), then a sparse block: the router
(`feed_forward.gate`, no bias) in the model dtype, scores = sigmoid(logits); the top k of scores + `expert_bias`
(fp32, for the choice only), each weighted by its score, renormalised (+ 1e-6) when `norm_topk_prob`, times
`routed_scaling_factor`, all in the model dtype as transformers; SwiGLU experts (`experts.E.{w1, w3, w2}`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...config import moe_facts
from ...hybrid_facts import layer_types
from ...kernels.activation import sigmoid
from .decoder import BIASLESS, DecoderAttention, DecoderMLP, DecoderSpec
from .gated_deltanet import ConvWeight
from .hybrid_layer import HybridLayer
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .parallel import ColumnParallelLinear, RowParallelLinear, get_tp_state, mark_sharded
from .qwen3_moe import Qwen3MoeForCausalLM
from .recurrent_layer import RecurrentLayer

# checkpoint name -> the decoder's, per piece of a layer's name (model.layers.N.<piece>...)
_LAYER_NAMES = {"operator_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "feed_forward": "mlp"}
_ATTN_NAMES = {"out_proj": "o_proj", "q_layernorm": "q_norm", "k_layernorm": "k_norm"}
_MLP_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _eps(hf_config) -> float:
    return float(getattr(hf_config, "norm_eps", 1e-5))  # every norm's, whatever other eps keys the config has


def lfm2_ff_width(hf_config) -> int:
    """LFM2's dense feed-forward width (transformers' Lfm2MLP): intermediate_size, auto-adjusted when the config
    says so."""
    width = int(hf_config.intermediate_size)
    if getattr(hf_config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = int(getattr(hf_config, "block_multiple_of", 256))
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


class ShortConv(RecurrentLayer):
    """x [T, H] (the normed input) -> out_proj(C * conv(B * x)): B | C | x the three parts of in_proj's output, the
    causal depthwise convolution over each request's B * x (RecurrentLayer.conv: fp32 sums, one rounding; its last
    K - 1 inputs kept in the request's slot). Tensor parallelism: each rank its share of the hidden channels of
    B, C, x and the convolution, out_proj row-parallel."""

    has_state = False  # the convolution's history is the whole state

    def __init__(self, hf_config):
        super().__init__()
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "conv_bias", False))
        kernel, tp = int(getattr(hf_config, "conv_L_cache", 3)), get_tp_state()
        self.in_proj = ColumnParallelLinear(hidden, [hidden] * 3, bias=bias)  # B | C | x rows
        self.channels = self.in_proj.part_sizes[0]  # this rank's
        self.conv1d = ConvWeight(self.channels, kernel, bias=bias)  # the checkpoint's `conv.conv`
        self.out_proj = RowParallelLinear(hidden, hidden, bias=bias)
        if tp.size > 1:
            for param in (self.conv1d.weight, self.conv1d.bias):
                if param is not None:
                    mark_sharded(param, 0, tp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        md, pos_start = self.step()
        b, c, xs = self.in_proj(x).split(self.channels, dim=-1)
        conv = self.conv(b * xs, md, pos_start, self.conv1d.weight, self.conv1d.bias)
        return self.out_proj(c * conv)


class Lfm2Attention(DecoderAttention):
    """Llama's attention with per-head q/k RMSNorms (Llama's order, eps `norm_eps`) before the rotation."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.q_norm = RMSNorm(self.head_dim, _eps(hf_config))
        self.k_norm = RMSNorm(self.head_dim, _eps(hf_config))
        self.qk_norm = True


class Lfm2Layer(HybridLayer):
    """Attention, or a conv layer (`conv`, ShortConv), then the feed-forward."""

    attention_class = Lfm2Attention
    linear_name, linear_class = "conv", ShortConv

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, _eps(hf_config))


def route_lfm2(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scale: float,
               forced: torch.Tensor | None = None, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (model dtype) -> (weights [T, k] fp32, ids [T, k] int64), transformers' Lfm2MoeTopKRouter: the
    scores sigmoid(logits) in the model dtype; the top k of scores + bias [E] (fp32; scores alone without one); the
    chosen scores renormalised (+ 1e-6) and scaled in the model dtype. forced [T, k] int16 (routing replay): rows with
    ids >= 0 take them, weighted alike."""
    scores = sigmoid(logits, invariant)
    ids = torch.topk(scores if bias is None else scores + bias, k=top_k, dim=-1)[1]
    if forced is not None:
        ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return (weights * scale).float(), ids


class Lfm2MoeBlock(SparseMoeBlock):
    batch_invariant = False  # layers.set_batch_invariant: the scores' sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        self.scale = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        self.expert_bias = None
        if getattr(hf_config, "use_expert_bias", True):  # transformers' buffer, fp32 whatever the model dtype
            self.expert_bias = nn.Parameter(torch.empty(facts["num_experts"], dtype=torch.float32),
                                            requires_grad=False)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_lfm2(self.gate(x), self.expert_bias, self.top_k, self.norm_topk_prob, self.scale, forced,
                          self.batch_invariant)


class Lfm2ForCausalLM(Qwen3MoeForCausalLM):
    layer_class = Lfm2Layer
    checkpoint_fp32_suffixes = (".mlp.expert_bias",)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return BIASLESS

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts(type(self).__name__, self.config)
        if facts and layer_idx in facts["moe_layers"]:
            return Lfm2MoeBlock(self.config, layer_idx, facts)
        return DecoderMLP(self.config, self.spec(self.config), intermediate_size=self.dense_width())

    def dense_width(self) -> int:
        return lfm2_ff_width(self.config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name == "model.embedding_norm.weight":  # the final norm
            return (("model.norm.weight", tensor),)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            parts[3] = _LAYER_NAMES.get(parts[3], parts[3])
            if parts[3] == "self_attn":
                parts[4] = _ATTN_NAMES.get(parts[4], parts[4])
            elif parts[3] == "conv" and parts[4] == "conv":
                parts[4] = "conv1d"
            elif parts[3] == "mlp":  # dense: feed_forward.w1; sparse: feed_forward.experts.E.w1
                i = 6 if parts[4] == "experts" and len(parts) == 8 else 4
                parts[i] = _MLP_NAMES.get(parts[i], parts[i])
        return ((".".join(parts), tensor),)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    def dense_width(self) -> int:
        return int(self.config.intermediate_size)  # no adjustment
