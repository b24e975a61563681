"""Gated DeltaNet (`linear_attn`): Qwen3-Next's and Qwen3.5's linear-attention layer, as transformers computes it.

x [T, H] (the normed input) -> one projection to q | k | v (the convolution's channels), z (the output gate), b
(beta's logits) and a (the decay's); a causal depthwise convolution of width K over each request's q | k | v
inputs, then SiLU; q and k l2-normalised per head (q also times Dk^-0.5), beta = sigmoid(b), the log decay
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule over the request's state (kernels/gated_delta.py, in
fp32); an RMSNorm of each value head's output times silu(z) (weights used as stored, not 1 + w); out_proj.

The request's state (its last K - 1 convolution inputs, its [Hv, Dk, Dv] delta-rule state) lives in the rows of its
slot (ForwardContext's req_slots) of the tensors the runner binds (recurrent_layer.py).

Weights: Qwen3.5's `in_proj_qkv` [2 Hk Dk + Hv Dv, H] | `in_proj_z` [Hv Dv, H] | `in_proj_b`, `in_proj_a` [Hv, H]
are the rows of the one `in_proj`, in that order; Qwen3-Next's per-key-head groups (`in_proj_qkvz`, `in_proj_ba`)
are regrouped into them at load (qwen3_next.py). `conv1d.weight` [conv_dim, 1, K] (held [conv_dim, K]), `A_log`,
`dt_bias` [Hv], `norm.weight` [Dv], `out_proj.weight` [H, Hv Dv].
"""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.activation import sigmoid, silu, softplus
from ...kernels.dispatch import use_fused_kernels
from ...kernels.gated_delta import delta_rule_torch, delta_rule_triton
from .decoder import norm_eps
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state, mark_sharded
from .recurrent_layer import RecurrentLayer

# HF's l2norm: x * rsqrt(sum(x^2) + eps) over each head, eps fixed
_L2_EPS = 1e-6
# the projection's parts in `in_proj`'s order (transformers' in_proj_qkv is cut into the first three at load)
IN_PROJ_PARTS = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a")


class ConvWeight(nn.Module):
    """A depthwise convolution's weight under its checkpoint name (`conv1d.weight`), held [C, K] (the checkpoints'
    [C, 1, K] loads flattened, as 3-D tensors do: decoder.flatten_experts), and its bias [C] where it has one
    (Mamba-2's); applied by kernels/gated_delta.conv_windows."""

    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None


class GatedRMSNorm(nn.Module):
    """transformers' Qwen3NextRMSNormGated over the last dim: the row normalised in fp32, cast back, times the
    weight (in the model dtype), times silu(z) in fp32, cast back."""

    batch_invariant = False  # layers.set_batch_invariant: silu from torch.exp (kernels/activation.sigmoid)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * silu(z.float(), self.batch_invariant)).to(x.dtype)


class GatedDeltaNet(RecurrentLayer):
    beta_scale = 1.0  # beta = beta_scale * sigmoid(b) (OLMo Hybrid's 2: negative eigenvalues allowed)

    def __init__(self, hf_config):
        super().__init__()
        hidden, tp = hf_config.hidden_size, get_tp_state()
        hk, hv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
        self.key_head_dim = int(hf_config.linear_key_head_dim)
        self.value_head_dim = int(hf_config.linear_value_head_dim)
        # this rank's heads (tensor parallelism: whole key heads with their value heads, hybrid_facts checks)
        self.num_k_heads = divide(hk, tp.size, "linear_num_key_heads")
        self.num_v_heads = divide(hv, tp.size, "linear_num_value_heads")
        self.key_dim = self.num_k_heads * self.key_head_dim
        self.value_dim = self.num_v_heads * self.value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kd, vd = hk * self.key_head_dim, hv * self.value_head_dim  # all ranks'
        # q | k | v | z | b | a rows, each part split between the ranks
        self.in_proj = ColumnParallelLinear(hidden, [kd, kd, vd, vd, hv, hv], bias=False)
        self.conv1d = ConvWeight(self.conv_dim, int(hf_config.linear_conv_kernel_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        if tp.size > 1:
            mark_sharded(self.conv1d.weight, 0, tp, 2 * kd + vd, [kd, kd, vd])
            for param in (self.A_log, self.dt_bias):
                mark_sharded(param, 0, tp, hv)
        self.norm = GatedRMSNorm(self.value_head_dim, norm_eps(hf_config))  # per head: the same on every rank
        self.out_proj = RowParallelLinear(vd, hidden, bias=False)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported for the linear-attention layers (silu)")

    def in_proj_shards(self) -> dict[str, tuple[str, int, int]]:
        """The projections' names (transformers' in_proj_qkv cut into its q, k and v: qwen3_next.py) -> (this
        module's name, first row, rows) inside this rank's in_proj."""
        sizes = (self.key_dim, self.key_dim, self.value_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return {name: ("in_proj", off, rows) for name, off, rows in zip(IN_PROJ_PARTS, offsets, sizes)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        md, pos_start = self.step()
        num_tokens, nv, dk = x.shape[0], self.num_v_heads, self.key_head_dim
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, nv, nv], dim=-1)
        conv = self.conv(mixed, md, pos_start, self.conv1d.weight)
        inv = self.batch_invariant
        q, k, v = silu(conv, inv).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.reshape(num_tokens, self.num_k_heads, dk).float()) * dk**-0.5
        k = _l2norm(k.reshape(num_tokens, self.num_k_heads, dk).float())
        v = v.reshape(num_tokens, nv, self.value_head_dim).float()
        beta = sigmoid(b, inv)  # [T, Hv]: the sigmoid in the model dtype, as transformers
        beta = (beta if self.beta_scale == 1.0 else beta * self.beta_scale).float()
        g = -self.A_log.float().exp() * softplus(a.float() + self.dt_bias, inv)  # [T, Hv] fp32
        rule = delta_rule_triton if use_fused_kernels(x.device) else delta_rule_torch
        o = rule(q, k, v, g.contiguous(), beta.contiguous(), self.state, md.req_slots, md.query_start_loc,
                 pos_start, md.max_query_len)  # [T, Hv, Dv] fp32
        o = self.norm(o.to(x.dtype), z.reshape(num_tokens, nv, self.value_head_dim))
        return self.out_proj(o.reshape(num_tokens, self.value_dim))


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)
