"""The Mamba-2 mixer (Granite 4.0-H's `mamba` layers, NemotronH's "M" layers), as transformers computes it.

x [T, H] (the normed input) -> in_proj -> z (the gate) | x B C (the convolution's channels) | dt (one per head); a
causal depthwise convolution of width K with its bias over each request's x | B | C inputs, then SiLU; dt =
softplus(dt + dt_bias) (clamped to `time_step_limit` where the config sets one); the selective state update per head
over the request's state (kernels/mamba_ssm.py, fp32), y = S C + D x; y * silu(z) RMS-normalised per group of
intermediate / n_groups channels (the gate before the norm), cast, times the norm's weight; out_proj.

The request's state (its last K - 1 convolution inputs, its [heads, head_dim, d_state] SSM state) lives in its slot's
rows of the tensors the runner binds (recurrent_layer.py), as for Gated DeltaNet (gated_deltanet.py).

Weights (Granite's `model.layers.N.mamba.*`, NemotronH's `mixer`): `in_proj.weight` [2 I + 2 G N + H, hidden]
(rows z | x | B | C | dt), `conv1d.weight` [I + 2 G N, 1, K] and `conv1d.bias`, `dt_bias`, `A_log`, `D` [H],
`norm.weight` [I], `out_proj.weight` [hidden, I]; in_proj / out_proj biases where the config says.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ...hybrid_facts import Mamba2Settings
from ...kernels.activation import silu, softplus
from ...kernels.dispatch import use_fused_kernels
from ...kernels.mamba_ssm import ssm_update_torch, ssm_update_triton
from .gated_deltanet import ConvWeight
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state, mark_sharded
from .recurrent_layer import RecurrentLayer


class GroupedGatedRMSNorm(nn.Module):
    """transformers' Mamba-2 gated norm: y * silu(z) in fp32, each group of `group` channels divided by its RMS,
    cast to the model dtype, times the weight."""

    batch_invariant = False  # layers.set_batch_invariant: silu from torch.exp (kernels/activation.sigmoid)

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [T, I] fp32, [T, I] -> [T, I]
        v = y.float() * silu(z.float(), self.batch_invariant)
        g = v.view(v.shape[0], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(v).to(z.dtype)


class Mamba2Mixer(RecurrentLayer):
    def __init__(self, hf_config):
        super().__init__()
        full, tp = Mamba2Settings.from_hf_config(hf_config), get_tp_state()
        # this rank's heads and groups of B / C (tensor parallelism: hybrid_facts checks they split evenly)
        dims = dataclasses.replace(full, n_heads=divide(full.n_heads, tp.size, "Mamba heads"),
                                   n_groups=divide(full.n_groups, tp.size, "Mamba n_groups"))
        self.dims = dims
        inter, gn, hidden = dims.intermediate, dims.n_groups * dims.d_state, hf_config.hidden_size
        inter_all, gn_all = full.intermediate, full.n_groups * full.d_state
        self.conv_dim = inter + 2 * gn
        # z | x | B | C | dt rows, each part split between the ranks
        self.in_proj = ColumnParallelLinear(hidden, [inter_all, inter_all, gn_all, gn_all, full.n_heads],
                                            bias=dims.proj_bias)
        self.conv1d = ConvWeight(self.conv_dim, dims.conv_kernel, bias=dims.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(dims.n_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(dims.n_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(dims.n_heads), requires_grad=False)
        self.norm = GroupedGatedRMSNorm(inter, inter // dims.n_groups, dims.eps)
        self.out_proj = RowParallelLinear(inter_all, hidden, bias=dims.out_proj_bias)
        if tp.size > 1:
            for param in (self.conv1d.weight, self.conv1d.bias):
                if param is not None:
                    mark_sharded(param, 0, tp, inter_all + 2 * gn_all, [inter_all, gn_all, gn_all])
            for param in (self.dt_bias, self.A_log, self.D):
                mark_sharded(param, 0, tp, full.n_heads)
            mark_sharded(self.norm.weight, 0, tp, inter_all)
        if dims.act != "silu":
            raise ValueError(f"the Mamba-2 layers' activation {dims.act!r} is not supported (silu)")
        low, high = (float(v) for v in (getattr(hf_config, "time_step_limit", None) or (0.0, math.inf)))
        self.dt_limit = None if (low, high) == (0.0, math.inf) else (low, high)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        y, z = self.scan(self.in_proj(x))
        return self.out_proj(self.norm(y, z))

    def scan(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj's output [T, I + conv_dim + H] -> (y [T, I] fp32, the gate z [T, I]): the convolution and the
        selective state update over each request's state."""
        md, pos_start = self.step()
        d, inv, num_tokens = self.dims, self.batch_invariant, zxbcdt.shape[0]
        gn = d.n_groups * d.d_state
        z, xbc, dt = zxbcdt.split([d.intermediate, self.conv_dim, d.n_heads], dim=-1)
        conv = self.conv(xbc, md, pos_start, self.conv1d.weight, self.conv1d.bias)
        xs, b, c = silu(conv, inv).split([d.intermediate, gn, gn], dim=-1)
        dt = softplus(dt + self.dt_bias.to(dt.dtype), inv)  # [T, H], the model dtype as transformers
        if self.dt_limit is not None:
            dt = dt.clamp(*self.dt_limit)
        rule = ssm_update_triton if use_fused_kernels(zxbcdt.device) else ssm_update_torch
        y = rule(xs.reshape(num_tokens, d.n_heads, d.head_dim).float(), dt.float().contiguous(),
                 -torch.exp(self.A_log.float()), b.reshape(num_tokens, d.n_groups, d.d_state).float(),
                 c.reshape(num_tokens, d.n_groups, d.d_state).float(), self.D.float(), self.state, md.req_slots,
                 md.query_start_loc, pos_start, md.max_query_len)  # [T, H, P] fp32
        return y.reshape(num_tokens, d.intermediate), z
