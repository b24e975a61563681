"""Jamba (`JambaForCausalLM`: AI21's Jamba v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large), as transformers computes it:
Llama's pre-norm layers whose mixer is attention without a positional encoding in the layers `layers_block_type`
calls attention (every `attn_layer_period`-th from `attn_layer_offset`), a Mamba-1 mixer elsewhere; the MLP a
Mixtral-style mixture of experts (softmax over the experts, the top k left unnormalised) where
`layers_num_experts` says, a SwiGLU elsewhere.

The Mamba-1 mixer (Mamba1Mixer): x | z = in_proj(h); x = silu(causal depthwise conv of width `mamba_d_conv` over the
request's x, with its bias); dt | B | C = x_proj(x), each RMS-normed (Jamba's dt / b / c layernorms); dt = softplus(
dt_proj.weight dt + dt_proj.bias) in the model dtype; per channel c and state element n, S = S exp(dt_c A_c,n) +
dt_c B_n x_c, y_c = sum_n S C_n + D_c x_c (kernels/mamba_ssm.py with head_dim 1 and A per state element, fp32; the
state per request: docs/hybrid_models.md); out_proj(y * silu(z)).

Weights: `feed_forward` (the MLP: `router` the experts' gate, `experts.E.*` or stacked), `pre_ff_layernorm`,
`model.final_layernorm`; the mixer's `mamba.{in_proj, conv1d, x_proj, dt_proj, A_log [I, N], D, out_proj,
dt_layernorm, b_layernorm, c_layernorm}`. Tensor parallelism is refused (hybrid_facts)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...config import moe_facts
from ...hybrid_facts import layer_types
from ...kernels.activation import silu, softplus
from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ...kernels.dispatch import use_fused_kernels
from ...kernels.mamba_ssm import ssm_update_torch, ssm_update_triton
from .decoder import DecoderMLP, DecoderSpec, norm_eps
from .gated_deltanet import ConvWeight
from .hybrid_layer import HybridLayer
from .layers import Linear, RMSNorm
from .moe import SparseMoeBlock
from .qwen3_moe import Qwen3MoeForCausalLM
from .recurrent_layer import RecurrentLayer
from .smollm3 import without_rotary

_NAMES = {"feed_forward": "mlp", "pre_ff_layernorm": "post_attention_layernorm"}


class Mamba1Mixer(RecurrentLayer):
    def __init__(self, hf_config):
        super().__init__()
        hidden, eps = hf_config.hidden_size, norm_eps(hf_config)
        self.inner, self.d_state = int(hf_config.mamba_expand * hidden), int(hf_config.mamba_d_state)
        rank = getattr(hf_config, "mamba_dt_rank", "auto")
        self.dt_rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
        proj_bias = bool(getattr(hf_config, "mamba_proj_bias", False))
        self.in_proj = Linear(hidden, 2 * self.inner, bias=proj_bias)  # x | z rows
        self.conv1d = ConvWeight(self.inner, int(hf_config.mamba_d_conv), bias=bool(hf_config.mamba_conv_bias))
        self.x_proj = Linear(self.inner, self.dt_rank + 2 * self.d_state)  # dt | B | C
        self.dt_proj = Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.inner, self.d_state), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        self.out_proj = Linear(self.inner, hidden, bias=proj_bias)
        self.dt_layernorm = RMSNorm(self.dt_rank, eps)
        self.b_layernorm = RMSNorm(self.d_state, eps)
        self.c_layernorm = RMSNorm(self.d_state, eps)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Jamba's Mamba layers with hidden_act {act!r} are not supported (silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] (normed) -> [T, hidden]
        md, pos_start = self.step()
        inv, num_tokens = self.batch_invariant, x.shape[0]
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        xs = silu(self.conv(xs, md, pos_start, self.conv1d.weight, self.conv1d.bias), inv)  # [T, I]
        dt, b, c = self.x_proj(xs).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_layernorm(dt)  # dt_proj without its bias, added before the softplus (transformers' order)
        dt = batch_invariant_linear(dt, self.dt_proj.weight, None) if inv else F.linear(dt, self.dt_proj.weight)
        dt = softplus(dt + self.dt_proj.bias.to(dt.dtype), inv)  # [T, I], the model dtype as transformers
        rule = ssm_update_triton if use_fused_kernels(x.device) else ssm_update_torch
        y = rule(xs.float().reshape(num_tokens, self.inner, 1), dt.float().contiguous(),
                 -torch.exp(self.A_log.float()), self.b_layernorm(b).float().reshape(num_tokens, 1, self.d_state),
                 self.c_layernorm(c).float().reshape(num_tokens, 1, self.d_state), self.D.float(), self.state,
                 md.req_slots, md.query_start_loc, pos_start, md.max_query_len)  # [T, I, 1] fp32
        return self.out_proj((y.reshape(num_tokens, self.inner) * silu(z.float(), inv)).to(x.dtype))


class JambaLayer(HybridLayer):
    linear_name, linear_class = "mamba", Mamba1Mixer


class JambaForCausalLM(Qwen3MoeForCausalLM):
    layer_class = JambaLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)
        without_rotary(layer for layer in self.model.layers if not layer.linear)  # no positional encoding

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts(type(self).__name__, self.config)
        if facts and layer_idx in facts["moe_layers"]:
            return SparseMoeBlock(self.config, layer_idx, facts)
        return DecoderMLP(self.config, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name == "model.final_layernorm.weight":
            return (("model.norm.weight", tensor),)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            parts[3] = _NAMES.get(parts[3], parts[3])
            if parts[3] == "mlp" and parts[4] == "router":
                parts[4] = "gate"
        return ((".".join(parts), tensor),)
