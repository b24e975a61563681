"""The Mamba-1 mixer (Jamba's `mamba` layers, Mamba's and FalconMamba's `mixer`), as transformers computes it.

x [T, H] (the normed input) -> in_proj -> x | z (inner wide each); x = silu(causal depthwise convolution of width
d_conv over the request's x, with its bias); dt | B | C = x_proj(x), each RMS-normed where the model says (Jamba:
weighted norms, FalconMamba: weightless ones, Mamba: none); dt = softplus(dt_proj.weight dt + dt_proj.bias) in the
model dtype; per channel c and state element n, S = S exp(dt_c A_c,n) + dt_c B_n x_c, y_c = sum_n S C_n + D_c x_c
(kernels/mamba_ssm.py with a head per channel of head_dim 1 and A per state element, fp32; the state per request in
its slot: recurrent_layer.py, docs/hybrid_models.md); out_proj(y * silu(z)).

Weights: `in_proj`, `conv1d` (with its bias), `x_proj`, `dt_proj` (weight and bias), `A_log` [inner, d_state], `D`
[inner], `out_proj`; Jamba's `dt_layernorm`, `b_layernorm`, `c_layernorm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...hybrid_facts import Mamba1Settings
from ...kernels.activation import silu, softplus
from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ...kernels.dispatch import use_fused_kernels
from ...kernels.mamba_ssm import ssm_update_torch, ssm_update_triton
from .gated_deltanet import ConvWeight
from .layers import Linear, RMSNorm
from .llama4 import WeightlessRMSNorm
from .recurrent_layer import RecurrentLayer


def _norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == "weighted":
        return RMSNorm(dim, eps)
    return WeightlessRMSNorm(dim, eps) if kind == "weightless" else nn.Identity()


class Mamba1Mixer(RecurrentLayer):
    def __init__(self, hf_config):
        super().__init__()
        m = Mamba1Settings.from_hf_config(hf_config)
        hidden = hf_config.hidden_size
        self.inner, self.d_state, self.dt_rank = m.inner, m.d_state, m.dt_rank
        self.in_proj = Linear(hidden, 2 * self.inner, bias=m.proj_bias)  # x | z rows
        self.conv1d = ConvWeight(self.inner, m.d_conv, bias=m.conv_bias)
        self.x_proj = Linear(self.inner, self.dt_rank + 2 * self.d_state)  # dt | B | C
        self.dt_proj = Linear(self.dt_rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.inner, self.d_state), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        self.out_proj = Linear(self.inner, hidden, bias=m.proj_bias)
        self.dt_layernorm = _norm(m.norms, self.dt_rank, m.eps)
        self.b_layernorm = _norm(m.norms, self.d_state, m.eps)
        self.c_layernorm = _norm(m.norms, self.d_state, m.eps)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Mamba-1 layers with hidden_act {act!r} are not supported (silu)")

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
