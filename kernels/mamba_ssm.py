"""Mamba-2's selective state update (Granite 4.0-H's Mamba layers) over a step's packed tokens, one token after
another, from each request's state in its slot (the state's layout and lifetime: kernels/gated_delta.py's module
docstring; the convolution before it is gated_delta.conv_windows).

Per head h (group g = h // (heads / n_groups)), token t, state S [head_dim, d_state]:
    S = S * exp(dt_t A_h) + (dt_t B_g,t) (x) x_t;  y_t = S C_g,t + D_h x_t
with dt already softplus'd (and clamped) by the caller, A_h = -exp(A_log_h). transformers' decode step
(`mamba2_selective_state_update`) in that order; its prefill runs the chunked (SSD) form of the same recurrence, other
roundings. Mamba-1 (Jamba's layers) is the case head_dim 1, a head per channel, one group, with A per channel and
state element: A [H, N], S = S * exp(dt_t A_h,n) + ... (transformers' `mamba_selective_state_update`).
`ssm_update_torch` is the reference, `ssm_update_triton` one program per (request, head, block of head_dim rows), its
state block in registers over the request's tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_delta import stepwise_rows


def ssm_update_torch(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                     d: torch.Tensor, state: torch.Tensor, req_slots: torch.Tensor, query_start_loc: torch.Tensor,
                     pos_start: torch.Tensor, max_query_len: int) -> torch.Tensor:
    """x [T, H, P] fp32; dt [T, H] fp32; a [H] (or [H, N]: Mamba-1's) and d [H] fp32; b, c [T, G, N] fp32; state
    [S, H, P, N] fp32, rows req_slots [B] read (zeros where pos_start is 0) and written back; query_start_loc [B + 1].
    Returns y [T, H, P] fp32 (gated_delta.stepwise_rows' loop)."""
    r = x.shape[1] // b.shape[1]

    def step(s: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtt, xt = dt[idx], x[idx]  # [B, H], [B, H, P]
        bt = b[idx].repeat_interleave(r, dim=1)  # [B, H, N]: head h reads group h // r
        ct = c[idx].repeat_interleave(r, dim=1)
        decay = torch.exp(dtt[..., None] * a)[:, :, None, :] if a.dim() == 2 else torch.exp(dtt * a)[..., None, None]
        s = s * decay + (dtt[..., None] * bt)[:, :, None, :] * xt[..., None]
        return s, (s * ct[:, :, None, :]).sum(-1) + d[:, None] * xt

    return stepwise_rows(step, state, req_slots, query_start_loc, pos_start, max_query_len, x.shape)


@triton.jit
def _ssm_update_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, state_ptr, slots_ptr, qsl_ptr,
                       pos_start_ptr, stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
                       stride_yt, stride_yh, stride_ss, stride_sh, stride_sp,
                       R: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                       A_PER_STATE: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    rp = tl.program_id(2) * BP + tl.arange(0, BP)
    rn = tl.arange(0, BN)
    mp = rp < P
    mn = rn < N
    slot = tl.load(slots_ptr + row)
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    has_state = tl.load(pos_start_ptr + row) > 0
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + rp[:, None] * stride_sp + rn[None, :]
    mask = mp[:, None] & mn[None, :]
    s = tl.load(s_ptrs, mask=mask & has_state, other=0.0)  # [BP, BN] fp32
    if A_PER_STATE:  # Mamba-1: A [H, N], one decay per state element
        a = tl.load(a_ptr + h * N + rn, mask=mn, other=0.0)[None, :]
    else:
        a = tl.load(a_ptr + h)
    d = tl.load(d_ptr + h)
    g = h // R
    for t in range(start, end):
        xt = tl.load(x_ptr + t * stride_xt + h * stride_xh + rp, mask=mp, other=0.0)
        dtt = tl.load(dt_ptr + t * stride_dtt + h)
        bt = tl.load(b_ptr + t * stride_bt + g * stride_bg + rn, mask=mn, other=0.0)
        ct = tl.load(c_ptr + t * stride_ct + g * stride_cg + rn, mask=mn, other=0.0)
        s = s * tl.exp(dtt * a) + (dtt * bt)[None, :] * xt[:, None]
        tl.store(y_ptr + t * stride_yt + h * stride_yh + rp, tl.sum(s * ct[None, :], axis=1) + d * xt, mask=mp)
    tl.store(s_ptrs, s, mask=mask)


def ssm_update_triton(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                      d: torch.Tensor, state: torch.Tensor, req_slots: torch.Tensor, query_start_loc: torch.Tensor,
                      pos_start: torch.Tensor, max_query_len: int = 0) -> torch.Tensor:
    """ssm_update_torch's contract in one launch (max_query_len unused: each program loops over its own row's
    tokens). Slots distinct except the graphs' padding slot."""
    num_tokens, num_heads, head_dim = x.shape
    d_state = b.shape[2]
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    bp = min(16, triton.next_power_of_2(head_dim))
    grid = (req_slots.shape[0], num_heads, triton.cdiv(head_dim, bp))
    if grid[0] == 0:
        return y
    assert x.stride(2) == 1 and b.stride(2) == 1 and c.stride(2) == 1 and state.stride(3) == 1 and dt.stride(1) == 1
    assert a.is_contiguous()
    _ssm_update_kernel[grid](
        x, dt, a, b, c, d, y, state, req_slots, query_start_loc, pos_start,
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        y.stride(0), y.stride(1), state.stride(0), state.stride(1), state.stride(2),
        R=num_heads // b.shape[1], P=head_dim, N=d_state, BP=bp, BN=triton.next_power_of_2(d_state),
        A_PER_STATE=a.dim() == 2, num_warps=4)
    return y
