"""Paged attention in Triton: varlen prefill (causal, through the block table) and split-context decode.

Reference: `model_runner_v2.attention.paged_attention_torch` (the "torch" backend; test_paged_attention.py).

Layouts shared by every kernel here:
  q            [T, Hq, D]                              last dim contiguous, any token/head strides
  kv_cache     [2, num_blocks, block_size, Hkv, D]     index 0 = K, 1 = V; contiguous; q's dtype or an fp8 format
                                                       (EngineConfig.kv_cache_dtype: each tile is converted to q's
                                                       dtype, exactly, before its dots)
  block_tables [B, max_blocks] int32                   physical block of each request's logical block
  seq_lens     [B] int64                               context length after this step (cached + scheduled)
Key position j of request b lives in block `block_tables[b, j // block_size]`, offset `j % block_size`, so
prefix-cache hits and earlier prefill chunks are read exactly like keys written this step. Query heads map to
KV heads in groups (GQA): q head h reads kv head h // (Hq // Hkv). Softmax runs online in fp32, in base 2
(scores are pre-multiplied by scale * log2(e)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_inputs import (
    alibi_args,
    check_attention_inputs,
    local_args,
    out_buffer,
    score_args,
    sinks_args,
    upcast,
)
from .attention_tile import (
    NEG_INIT,
    alibi_bias,
    attend_tile,
    combine_splits,
    first_visible_key,
    fold_sink,
    load_kv_tile,
    load_sink,
)
from .decode_launch import (
    DECODE_MAX_SPLITS,
    decode_counters,
    decode_min_split_len,
    decode_num_splits,
    decode_tile,
    reduce_rows,
)
from .device_info import sm_count
from .paged_decode_reduce import _paged_decode_reduce_kernel
from .pdl import pdl_options, wait_for_predecessor
from .prefill_launch import find_query_block, prefill_block_q, prefill_grid, prefill_override, prefill_tile

# The fused reduce's split padding: one variant for any split count (at most DECODE_MAX_SPLITS)
DECODE_SPLITS_PAD = triton.next_power_of_2(DECODE_MAX_SPLITS)


@triton.jit(do_not_specialize=["stride_bt", "num_reqs", "blocks_per_req"])
def _paged_prefill_kernel(
    out_ptr,  # [T, Hq, D], written (q's dtype on CUDA, fp32 under the interpreter)
    q_ptr,  # [T, Hq, D]
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int64, prefix sums of query lengths
    seq_lens_ptr,  # [B] int64
    num_reqs,  # B (host ints that change from step to step, not specialised on)
    blocks_per_req,  # programs per request, or 0: the flat numbering (kernels/prefill_launch.py prefill_grid)
    scale_log2,  # float: softmax scale * log2(e) (SOFTCAP: scale / cap; score_args)
    window,  # SLIDING: a query at position p sees keys p - window < k <= p; CHUNKED: the chunk size
    softcap,  # SOFTCAP: cap * log2(e) (score_args)
    sinks_ptr,  # SINKS: [Hq] one logit per q head (GPT-OSS; attention_inputs.sinks_args)
    alibi_ptr,  # ALIBI: [Hq] fp32 slopes (BLOOM; attention_inputs.alibi_args)
    stride_qt, stride_qh,  # q strides (elements) between tokens, heads
    stride_ot, stride_oh,  # out strides
    stride_kv, stride_kb, stride_ks, stride_kh,  # kv_cache strides: K->V, block, offset in block, kv head
    stride_bt,  # block_tables row stride
    GROUP: tl.constexpr,  # Hq // Hkv
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_SIZE: tl.constexpr,  # KV-cache block size (tokens per page)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    UPCAST: tl.constexpr,  # fp32 dots (fp32 inputs, and the interpreter where bf16 math is broken)
    SLIDING: tl.constexpr = False,  # sliding-window attention (`window`); False: the full causal mask
    SOFTCAP: tl.constexpr = False,  # Gemma 2's scores cap * tanh(s * scale / cap) (attention_tile.attend_tile)
    SINKS: tl.constexpr = False,  # a sink logit per q head in the denominator (attention_tile.fold_sink)
    ALIBI: tl.constexpr = False,  # scores + slope * (key - query position) (attention_tile.alibi_bias)
    CHUNKED: tl.constexpr = False,  # chunked attention (Llama 4): keys in the query's chunk of `window` positions
):
    # One program per (request, block of BLOCK_Q query tokens, kv head), the first two numbered along grid axis 0
    # (kernels/prefill_launch.py `prefill_grid`); its rows are the BLOCK_Q x GROUP (query token, q head of the
    # group) pairs, so each K/V tile is loaded once per group. A program's work depends on its (request, query
    # block) only, never on the grid or the other requests: batch-invariant mode relies on that.
    req, q_block = find_query_block(query_start_loc_ptr, num_reqs, blocks_per_req, tl.program_id(0), BLOCK_Q)
    kv_head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # a spare program (prefill_grid)
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # tokens cached before this step's chunk (prefix hits, earlier chunks)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [M] query index inside the request's chunk
    g = offs_m % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < GROUP)
    head = kv_head * GROUP + g  # [M] q head
    q_pos = ctx_len + q_idx  # [M] absolute position: query i sits at seq_len - q_len + i
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + head * stride_qh  # [M]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634 if ALIBI else 0.0  # log2(e)
    # Keys past the last query of this block are causally invisible to every row: stop there.
    k_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    # With a window (or chunks), tiles before the first query's first visible key are invisible to every row (that
    # key only grows with the position): start at the tile holding it (tiles stay aligned to BLOCK_N from key 0; a
    # fully masked tile would leave the softmax state bit-identical anyway, which batch-invariant mode relies on).
    k_lo = 0
    if SLIDING or CHUNKED:
        k_lo = tl.maximum(first_visible_key(ctx_len + q_block * BLOCK_Q, window, SLIDING, CHUNKED), 0)
        k_lo = k_lo // BLOCK_N * BLOCK_N
    for start in range(k_lo, k_end, BLOCK_N):
        k_pos = start + offs_n  # [N]
        k_ok = k_pos < k_end
        kt, v = load_kv_tile(kv_ptr, block_tables_ptr, req, stride_bt, k_pos, k_ok, kv_head, offs_d, d_ok,
                              stride_kv, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if SLIDING or CHUNKED:
            visible = visible & (k_pos[None, :] >= first_visible_key(q_pos[:, None], window, SLIDING, CHUNKED))
        bias = alibi_bias(slope, k_pos, q_pos[:, None]) if ALIBI else 0.0
        m_i, l_i, acc = attend_tile(q, kt, v, visible, m_i, l_i, acc, scale_log2, UPCAST, softcap, SOFTCAP, bias,
                                    ALIBI)

    if SINKS:
        sink = load_sink(sinks_ptr, head, row_ok)
        l_i, acc = fold_sink(m_i, l_i, acc, sink)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows (l = 0) are not stored
    o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    out_ptr,  # [B, Hq, D], written when not SPLIT (like the prefill kernel's out)
    part_acc_ptr,  # [B, Hq, num_splits, D] fp32, unnormalised partial outputs (SPLIT)
    part_ml_ptr,  # [B, Hq, num_splits, 2] fp32, partial running max (base 2) and sum of exponentials (SPLIT)
    q_ptr,  # [B, Hq, D], one query token per sequence
    kv_ptr,  # [2, num_blocks, BLOCK_SIZE, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int64
    counter_ptr,  # [B, Hkv] int32, zero between launches: splits done per (sequence, kv head) (FUSED_REDUCE)
    scale_log2,  # float: softmax scale * log2(e) (SOFTCAP: scale / cap)
    window,  # SLIDING: the query (position seq_len - 1) sees keys seq_len - window <= k < seq_len; CHUNKED: chunk size
    softcap,  # SOFTCAP: cap * log2(e)
    sinks_ptr,  # SINKS: [Hq] one logit per q head, added where the output is normalised (here or the combine)
    alibi_ptr,  # ALIBI: [Hq] fp32 slopes
    min_split_len,  # fewest keys per non-empty split (a multiple of BLOCK_N); num_splits = grid dimension 2
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kv, stride_kb, stride_ks, stride_kh,
    stride_bt,
    SPLIT: tl.constexpr,  # False (one split): write the output directly; True: partials for the reduce kernel
    FUSED_REDUCE: tl.constexpr,  # SPLIT only: the last split of each (sequence, kv head) combines, no reduce kernel
    SPLITS_PAD: tl.constexpr,  # FUSED_REDUCE: a power of two >= num_splits (DECODE_SPLITS_PAD, one variant)
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # >= GROUP, >= 16 (tl.dot's minimum M on GPU), power of two
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py)
    SLIDING: tl.constexpr = False,  # sliding-window attention (`window`); False: every key
    SOFTCAP: tl.constexpr = False,  # Gemma 2's capped scores
    SINKS: tl.constexpr = False,  # GPT-OSS's attention sinks
    ALIBI: tl.constexpr = False,  # BLOOM's linear biases
    CHUNKED: tl.constexpr = False,  # chunked attention (Llama 4): only the keys in the query's chunk
):
    # One program per (sequence, kv head, context split); rows are the q heads of the group.
    wait_for_predecessor(PDL)
    # The query is the sequence's last token, so it sees every key: no causal mask, only the split bounds.
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    # Splits are sized by this sequence's own length, not the grid's (a CUDA graph fixes num_splits for
    # max_model_len): ceil(seq_len / num_splits) keys rounded up to BLOCK_N, at least min_split_len, so a short
    # context uses few splits and a long one uses them all. Trailing splits past seq_len are empty.
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, tl.num_programs(2)), BLOCK_N) * BLOCK_N, min_split_len)
    k_begin = split * split_len
    k_stop = tl.minimum(seq_len, k_begin + split_len)  # k_stop <= k_begin: an empty split (short sequence)

    g = tl.arange(0, GROUP_PAD)
    row_ok = g < GROUP
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], NEG_INIT, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634 if ALIBI else 0.0  # log2(e)
    k_lo = k_begin
    if SLIDING or CHUNKED:  # keys before the window / chunk: a split wholly before it stays empty (m = -1e30, l = 0)
        k_lo = tl.maximum(k_begin, first_visible_key(seq_len - 1, window, SLIDING, CHUNKED))
    for start in range(k_lo, k_stop, BLOCK_N):
        k_pos = start + offs_n
        k_ok = k_pos < k_stop
        kt, v = load_kv_tile(kv_ptr, block_tables_ptr, req, stride_bt, k_pos, k_ok, kv_head, offs_d, d_ok,
                              stride_kv, stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        bias = alibi_bias(slope, k_pos, seq_len - 1) if ALIBI else 0.0  # the query sits at seq_len - 1
        m_i, l_i, acc = attend_tile(q, kt, v, k_ok[None, :], m_i, l_i, acc, scale_log2, UPCAST,  # [G, N] scores
                                    softcap, SOFTCAP, bias, ALIBI)

    if not SPLIT:
        if SINKS:
            sink = load_sink(sinks_ptr, head, row_ok)
            l_i, acc = fold_sink(m_i, l_i, acc, sink)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = req.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials are contiguous [B, Hq, num_splits, ...]; an empty split stores (m = -1e30, l = 0, acc = 0).
        part = (req.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * tl.num_programs(2) + split  # [G]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if FUSED_REDUCE:
            # The threadfence-reduction pattern: every thread's stores above, a CTA barrier, then one release
            # (acq_rel) increment of this (sequence, kv head)'s counter; the program that sees the count reach
            # num_splits - 1 is the last, and its acquire makes every other split's partials visible to it. It
            # combines them as the reduce kernel does (combine_splits) and zeroes the counter for the next launch.
            tl.debug_barrier()
            slot = counter_ptr + req * tl.num_programs(1) + kv_head
            done = tl.atomic_add(slot, 1, sem="acq_rel", scope="gpu")
            if done == tl.num_programs(2) - 1:
                for gi in tl.static_range(GROUP):
                    h = kv_head * GROUP + gi
                    sink = 0.0
                    if SINKS:
                        sink = load_sink(sinks_ptr, h, h >= 0)
                    combine_splits(out_ptr, part_acc_ptr, part_ml_ptr,
                                   req.to(tl.int64) * (GROUP * tl.num_programs(1)) + h,
                                   req.to(tl.int64) * stride_ot + h * stride_oh, tl.num_programs(2),
                                   SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, True, sink, SINKS)
                tl.store(slot, 0)


# -- launchers ------------------------------------------------------------------------------------------------


def paged_prefill_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                                   seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                                   max_query_len: int, block_q: int | None = None,
                                   tile: tuple[int, int, int] | None = None, window: int = 0,
                                   softcap: float = 0.0, sinks: torch.Tensor | None = None,
                                   alibi: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Causal attention of every scheduled query over its request's paged context (prefill, chunked prefill,
    prefix hits, and decode rows mixed in).

    q [T, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D] (this step's K/V already written);
    query_start_loc [B + 1] int64; seq_lens [B] int64; block_tables [B, max_blocks] int32;
    max_query_len: host int (block_q and the grid without a device sync: no row may be longer; `prefill_grid`);
    block_q: query tokens per program (None: chosen from max_query_len;
    kernels/batch_invariant_attention.py fixes it); tile: (BLOCK_N, num_warps,
    num_stages), None = the dtype's (kernels/prefill_launch.py); window > 0: sliding-window attention (a query
    at position p sees keys p - window < k <= p); softcap > 0: scores capped (Gemma 2's attn_logit_softcapping);
    sinks [Hq]: one more logit per q head in each softmax's denominator (GPT-OSS); alibi [Hq] fp32: ALiBi's
    slopes (BLOOM); chunk > 0: chunked attention (Llama 4: a query at p sees keys p // chunk * chunk <= k <= p).
    Returns [T, Hq, D] in q's dtype.
    """
    q, group = check_attention_inputs(q, kv_cache, block_tables, seq_lens)
    window, chunked = local_args(window, chunk)
    if query_start_loc.dtype != torch.int64 or query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError("query_start_loc must be int64 [B + 1]")
    num_tokens, num_heads, head_dim = q.shape
    out = out_buffer((num_tokens, num_heads, head_dim), q)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out.to(q.dtype)
    group_pad = triton.next_power_of_2(group)
    # kernels/prefill_launch.py: the measured defaults, or REPLAYLLM_PREFILL_TILE's (never over a caller's fixed
    # block_q / tile: batch-invariant mode's).
    override = prefill_override() if block_q is None and tile is None else None
    if override is not None:
        block_q, tile = override[0], override[1:]
    if block_q is None:
        block_q = prefill_block_q(max_query_len, group_pad)
    block_n, warps, stages = tile or prefill_tile(q.dtype, head_dim)
    programs, blocks_per_req = prefill_grid(num_tokens, num_reqs, max_query_len, block_q)
    sinks_ptr, has_sinks = sinks_args(sinks, q)
    alibi_ptr, has_alibi = alibi_args(alibi, q)
    _paged_prefill_kernel[(programs, kv_cache.shape[3])](
        out, q, kv_cache, block_tables, query_start_loc, seq_lens, num_reqs, blocks_per_req,
        *score_args(scale, window, softcap), sinks_ptr, alibi_ptr,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast(q), SLIDING=window > 0 and not chunked, SOFTCAP=softcap > 0, SINKS=has_sinks, ALIBI=has_alibi,
        CHUNKED=chunked, num_warps=warps, num_stages=stages,
    )
    return out.to(q.dtype)


def paged_decode_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                                  block_tables: torch.Tensor, scale: float, max_seq_len: int,
                                  num_splits: int | None = None, window: int = 0, softcap: float = 0.0,
                                  sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                                  chunk: int = 0) -> torch.Tensor:
    """Attention of one query token per sequence (its last position) over the sequence's paged context,
    split along the context (flash-decoding) when it is long, then reduced.

    q [B, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D]; seq_lens [B] int64; block_tables
    [B, max_blocks] int32; max_seq_len: host int; num_splits: None = `decode_num_splits(...)`; window > 0:
    only the last `window` keys; softcap > 0: capped scores; sinks [Hq]: attention sinks (GPT-OSS); alibi [Hq]:
    ALiBi's slopes; chunk > 0: only the keys of the query's chunk (Llama 4). Returns [B, Hq, D] in q's dtype.
    """
    q, group = check_attention_inputs(q, kv_cache, block_tables, seq_lens)
    window, chunked = local_args(window, chunk)
    num_seqs, num_heads, head_dim = q.shape
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError(f"decode needs one query per sequence: q has {num_seqs} rows, seq_lens "
                         f"{seq_lens.shape[0]}, block_tables {block_tables.shape[0]}")
    out = out_buffer((num_seqs, num_heads, head_dim), q)
    if num_seqs == 0:
        return out.to(q.dtype)
    num_kv_heads = kv_cache.shape[3]
    sms = sm_count(q.device)
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_seq_len, sms)
    if not 1 <= num_splits <= DECODE_MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {DECODE_MAX_SPLITS}], got {num_splits}")
    block_n, num_warps, num_stages = decode_tile(q.dtype, head_dim, num_seqs * num_kv_heads * num_splits,
                                                  group)
    min_split_len = triton.cdiv(decode_min_split_len(num_seqs, num_kv_heads, sms), block_n) * block_n
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    counters = None
    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
        counters = decode_counters(q.device, num_seqs * num_kv_heads)  # None: the reduce kernel combines
    else:
        part_acc = part_ml = out  # not touched by the kernel
    sinks_ptr, has_sinks = sinks_args(sinks, q)
    alibi_ptr, has_alibi = alibi_args(alibi, q)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part_acc, part_ml, q, kv_cache, block_tables, seq_lens, seq_lens if counters is None else counters,
        *score_args(scale, window, softcap), sinks_ptr, alibi_ptr, min_split_len,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        SPLIT=num_splits > 1, FUSED_REDUCE=counters is not None,
        SPLITS_PAD=DECODE_SPLITS_PAD if counters is not None else 1,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, UPCAST=upcast(q),
        SLIDING=window > 0 and not chunked, SOFTCAP=softcap > 0, SINKS=has_sinks, ALIBI=has_alibi,
        CHUNKED=chunked, num_warps=num_warps, num_stages=num_stages,
        **pdl_options(q.device),
    )
    if num_splits > 1 and counters is None:
        rows = reduce_rows(num_seqs, num_heads)
        _paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, rows))](
            out, part_acc, part_ml, sinks_ptr, num_splits, out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, NUM_HEADS=num_heads, ROWS=rows, SINKS=has_sinks, **pdl_options(q.device),
        )
    return out.to(q.dtype)
