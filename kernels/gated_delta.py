"""Gated DeltaNet's per-request recurrence (Qwen3-Next, Qwen3.5's linear-attention layers) over a step's packed
tokens: the causal depthwise convolution over each request's last K inputs, and the gated delta rule's state
update, one token after another.

Each request owns a slot (model_runner_v2/request_states.py) and, per linear-attention layer, two state rows there:
its last K - 1 convolution inputs [K - 1, C] and its delta-rule state [Hv, Dk, Dv] (fp32, as transformers keeps
it). A step reads the rows of its requests, runs their tokens and writes the rows back; a row whose first token is
position 0 (a new or recomputed request) starts from zeros, whatever its slot held.

Token by token, in every step: the recurrence runs the same arithmetic whether a prompt arrives in one step or in
chunks, alone or beside other requests, as a prefill or one decode token at a time. So a request's numbers depend
on its tokens alone (batch invariance and trace replay need nothing more here), at the price of a sequential loop
over a prompt's tokens (transformers' one-pass forward uses the chunked form: the same maths, other roundings,
~1e-6 apart in fp32).

The recurrence per value head h (key head h // (Hv / Hk)), token t, state S [Dk, Dv]:
    S = S * exp(g_t);  delta = (v_t - S^T k_t) * beta_t;  S = S + k_t delta^T;  o_t = S^T q_t
(Kimi Delta Attention: g_t a vector over the key channels, S's row i times exp(g_t[i]))
with q, k l2-normalised (q also scaled by Dk^-0.5) by the caller. `delta_rule_torch` is the reference (CPU and the
unfused path), `delta_rule_triton` one program per (request, value head, block of Dv columns) keeping its state
block in registers over the request's tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def conv_windows(x: torch.Tensor, conv_state: torch.Tensor, req_slots: torch.Tensor, token_row: torch.Tensor,
                 positions: torch.Tensor, pos_start: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The causal depthwise convolution of the step's tokens (no activation), and each row's new last inputs
    written to its slot.

    x [T, C] (the step's inputs, packed by row); conv_state [S, K - 1, C] (model dtype); req_slots [B];
    token_row [T]; positions [T] (absolute); pos_start [B] (each row's first position in this step);
    query_start_loc [B + 1]; seq_lens [B]; weight [C, K] (weight[:, K - 1] meets the current token).
    Returns [T, C]: sum over m of weight[:, m] * input at position p - (K - 1) + m, accumulated in fp32 in that
    order, plus bias [C] (Mamba-2's) where given, rounded once to out_dtype (default x's; Inkling's fp32: its residual
    added before the one rounding) (zeros before position 0). All on the device: no host read (CUDA-graph safe).
    """
    num_tokens, _ = x.shape
    k = weight.shape[1]
    device = x.device
    taps = torch.arange(k, device=device)
    old = conv_state.index_select(0, req_slots)  # [B, K - 1, C]: read before the rows are written below
    window = _inputs_at(x, old, token_row, positions[:, None] - (k - 1) + taps, pos_start,
                        torch.arange(num_tokens, device=device)[:, None] - (k - 1) + taps)  # [T, K, C]
    w = weight.float()
    acc = window[:, 0].float() * w[:, 0]
    for m in range(1, k):
        acc = acc + window[:, m].float() * w[:, m]
    if bias is not None:
        acc = acc + bias.float()
    # Each row's new history: its inputs at positions seq_len - (K - 1) .. seq_len - 1.
    rows = torch.arange(req_slots.shape[0], device=device)
    hist = taps[: k - 1]
    last = seq_lens[:, None] - (k - 1) + hist  # [B, K - 1]
    tok = query_start_loc[:-1, None] + (last - pos_start[:, None])  # the step's token at that position
    conv_state.index_copy_(0, req_slots, _inputs_at(x, old, rows, last, pos_start, tok))
    return acc.to(out_dtype or x.dtype)


def _inputs_at(x: torch.Tensor, old: torch.Tensor, row: torch.Tensor, pos: torch.Tensor, pos_start: torch.Tensor,
               tok: torch.Tensor) -> torch.Tensor:
    """[N, M, C]: the input at absolute position pos[n, m] of request row[n]: this step's token tok[n, m] where pos
    is in the step, the row's saved history old[row, pos - pos_start + K - 1] before it, zero before position 0."""
    km1 = old.shape[1]
    start = pos_start[row][:, None]  # [N, 1]
    in_step = pos >= start
    from_step = x[tok.clamp(0, x.shape[0] - 1)]  # [N, M, C]
    hist_idx = (pos - start + km1).clamp(0, max(km1 - 1, 0))
    from_hist = old[row[:, None], hist_idx] if km1 else torch.zeros_like(from_step)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(in_step[..., None], from_step, torch.where((pos >= 0)[..., None], from_hist, zero))


def delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, req_slots: torch.Tensor, query_start_loc: torch.Tensor,
                     pos_start: torch.Tensor, max_query_len: int) -> torch.Tensor:
    """q, k [T, Hk, Dk] fp32 (normalised, q scaled); v [T, Hv, Dv] fp32; g (log decay) [T, Hv] fp32, or [T, Hv, Dk]
    (Kimi Delta Attention: a decay per key channel, each state row its own); beta [T, Hv] fp32;
    state [S, Hv, Dk, Dv] fp32, rows req_slots [B] read (zeros where pos_start is 0) and written back;
    query_start_loc [B + 1]. Returns o [T, Hv, Dv] fp32."""
    r = v.shape[1] // k.shape[1]

    def step(s: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kt = k[idx].repeat_interleave(r, dim=1)  # [B, Hv, Dk]: value head h reads key head h // r
        qt = q[idx].repeat_interleave(r, dim=1)
        decay = g[idx].exp()  # [B, Hv] or [B, Hv, Dk]
        s = s * (decay[..., None] if g.dim() == 3 else decay[..., None, None])
        kv_mem = (s * kt[..., None]).sum(-2)  # [B, Hv, Dv]
        s = s + kt[..., None] * ((v[idx] - kv_mem) * beta[idx][..., None])[..., None, :]
        return s, (s * qt[..., None]).sum(-2)

    return stepwise_rows(step, state, req_slots, query_start_loc, pos_start, max_query_len, v.shape)


def stepwise_rows(step, state: torch.Tensor, req_slots: torch.Tensor, query_start_loc: torch.Tensor,
                  pos_start: torch.Tensor, max_query_len: int, out_shape: torch.Size) -> torch.Tensor:
    """The torch references' loop: every row's state read from its slot (zeros where pos_start is 0), then for
    t < max_query_len (a host int) `step(states [B, ...], token index [B]) -> (new states, outputs [B, ...])` on
    each row's t-th token, kept where the row has one; the states written back. Returns the outputs [T, ...] fp32
    (out_shape: [T, ...])."""
    num_tokens = out_shape[0]
    s = state.index_select(0, req_slots)
    s = torch.where((pos_start > 0)[:, None, None, None], s, torch.zeros((), dtype=s.dtype, device=s.device))
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    out = torch.zeros(num_tokens + 1, *out_shape[1:], dtype=torch.float32, device=state.device)  # + a sink row
    for t in range(max_query_len):
        valid = t < q_lens  # [B]
        idx = (query_start_loc[:-1] + t).clamp(max=max(num_tokens - 1, 0))
        s_new, o = step(s, idx)
        out[torch.where(valid, idx, num_tokens)] = o
        s = torch.where(valid[:, None, None, None], s_new, s)
    state.index_copy_(0, req_slots, s)
    return out[:num_tokens]


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slots_ptr, qsl_ptr, pos_start_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                       stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, stride_gh,
                       R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       PER_CHANNEL: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    rk = tl.arange(0, BK)
    rv = tl.program_id(2) * BV + tl.arange(0, BV)
    mk = rk < DK
    mv = rv < DV
    slot = tl.load(slots_ptr + row)
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    has_state = tl.load(pos_start_ptr + row) > 0
    s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=mask & has_state, other=0.0)  # [BK, BV] fp32
    kh = h // R
    for t in range(start, end):
        kt = tl.load(k_ptr + t * stride_kt + kh * stride_kh + rk, mask=mk, other=0.0)
        qt = tl.load(q_ptr + t * stride_qt + kh * stride_qh + rk, mask=mk, other=0.0)
        vt = tl.load(v_ptr + t * stride_vt + h * stride_vh + rv, mask=mv, other=0.0)
        bt = tl.load(beta_ptr + t * stride_bt + h)
        if PER_CHANNEL:  # a decay per key channel: each state row its own
            gt = tl.load(g_ptr + t * stride_gt + h * stride_gh + rk, mask=mk, other=0.0)
            s = s * tl.exp(gt)[:, None]
        else:
            gt = tl.load(g_ptr + t * stride_gt + h)
            s = s * tl.exp(gt)
        kv_mem = tl.sum(s * kt[:, None], axis=0)  # [BV]
        delta = (vt - kv_mem) * bt
        s = s + kt[:, None] * delta[None, :]
        tl.store(o_ptr + t * stride_ot + h * stride_oh + rv, tl.sum(s * qt[:, None], axis=0), mask=mv)
    tl.store(s_ptrs, s, mask=mask)


def delta_rule_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor, req_slots: torch.Tensor, query_start_loc: torch.Tensor,
                      pos_start: torch.Tensor, max_query_len: int = 0) -> torch.Tensor:
    """delta_rule_torch's contract in one launch (max_query_len unused: each program loops over its own row's
    tokens, read on the device). Slots must be distinct except the graphs' padding slot (its rows' writes race,
    and nothing reads them)."""
    num_tokens, num_v_heads, dv = v.shape
    dk = k.shape[2]
    out = torch.empty(num_tokens, num_v_heads, dv, dtype=torch.float32, device=v.device)
    bv = min(32, triton.next_power_of_2(dv))
    grid = (req_slots.shape[0], num_v_heads, triton.cdiv(dv, bv))
    if grid[0] == 0:
        return out
    per_channel = g.dim() == 3  # [T, Hv, Dk]: Kimi Delta Attention's decay per key channel
    assert state.stride(3) == 1 and g.stride(-1) == 1 and beta.stride(1) == 1
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    _delta_rule_kernel[grid](
        q, k, v, g, beta, out, state, req_slots, query_start_loc, pos_start,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        g.stride(1) if per_channel else 0,
        R=num_v_heads // k.shape[1], DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, PER_CHANNEL=per_channel,
        num_warps=4)
    return out
