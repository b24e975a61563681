"""One step of the paged attention kernels' inner loop (kernels/paged_attention.py): a K/V tile read through the
block table, converted to q's dtype, and one online-softmax update over it (in base 2). Shared by the prefill,
decode and batch-invariant paths, so all of them read and accumulate a tile the same way. And the combine of a
split decode's partials (the reduce kernel's, and the fused reduce's last program's)."""

from __future__ import annotations

import triton
import triton.language as tl

NEG_INIT = tl.constexpr(-1.0e30)  # initial running max: finite, so fully masked rows give p = 0, not NaN


@triton.jit
def load_kv_tile(kv_ptr, block_tables_ptr, req, stride_bt, k_pos, k_ok, kv_head, offs_d, d_ok,
                  stride_kv, stride_kb, stride_ks, stride_kh, BLOCK_SIZE: tl.constexpr):
    """K transposed [D, N] and V [N, D] of keys k_pos [N] (masked by k_ok [N]) of one request and kv head,
    read through the request's block table row."""
    page = tl.load(block_tables_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
    slot = page.to(tl.int64) * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh  # [N]
    kt = tl.load(kv_ptr + slot[None, :] + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(kv_ptr + stride_kv + slot[:, None] + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                other=0.0)
    return kt, v


@triton.jit
def first_visible_key(q_pos, window, SLIDING: tl.constexpr, CHUNKED: tl.constexpr):
    """The first key position a query at q_pos sees (it sees keys first <= k <= q_pos): a sliding window's
    q_pos - window + 1 (the last `window` positions, its own included), chunked attention's start of q_pos's chunk
    of `window` positions (Llama 4: keys k with k // window == q_pos // window), else 0."""
    if SLIDING:
        return q_pos - window + 1
    elif CHUNKED:
        return q_pos // window * window
    else:
        return q_pos * 0


@triton.jit
def widen(x, like):
    """x (a K or V tile) in like's 16-bit dtype, as a tile that tl.dot sees as 16-bit data. An fp8 tile converted
    with a plain `.to()` reaches the dot as "8-bit data" (Triton walks back through pure elementwise ops to the
    load) and gets the 8-bit operand layout (kWidth 4 instead of 2): the head-dim products then land in other MMA
    slots, so the fp32 sums round differently from a 16-bit cache's (session 24 on the H200: fp16 q over an e5m2
    cache, batch-invariant tile, not bit for bit the widened cache). The conversion is exact; the `mov` after it
    is marked impure so that walk stops there: the dot then runs exactly as over a 16-bit cache (one more
    shared-memory round trip per tile, fp8 caches only)."""
    if x.dtype == like.dtype:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x.to(like.dtype)], dtype=like.dtype,
                                         is_pure=False, pack=1)


@triton.jit
def attend_tile(q, kt, v, visible, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr, softcap, SOFTCAP: tl.constexpr,
                bias=0.0, ALIBI: tl.constexpr = False):
    """One online-softmax step over a tile of N keys, in base 2. q [M, D]; kt [D, N]; v [N, D]; visible [M, N]
    (or broadcastable) bool; m_i, l_i [M] fp32 running max and sum of exponentials; acc [M, D] fp32
    unnormalised output. SOFTCAP (Gemma 2): the score is cap * tanh(s * scale / cap), scale_log2 = scale / cap
    and softcap = cap * log2(e) (paged_attention.score_args). ALIBI: `bias` [M, N] fp32 (base 2) added to the
    scaled scores (alibi_bias). Returns the updated (m_i, l_i, acc)."""
    # An fp8 cache's tiles become q's dtype here (exact: every fp8 value is a bf16/fp16/fp32 value), and the 16-bit
    # dots run as over a 16-bit cache (`widen`); a tile already in q's dtype is unchanged.
    if UPCAST:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")  # [M, N]
    else:
        s = tl.dot(q, widen(kt, q))
    if SOFTCAP:  # tanh(x) = 1 - 2 / (1 + e^2x): exp only (no libdevice under the interpreter); +-1 at the ends
        s = softcap * (1.0 - 2.0 / (1.0 + tl.exp2(s * scale_log2 * 2.8853900817779268)))  # 2 log2(e)
    else:
        s = s * scale_log2
    if ALIBI:
        s = s + bias
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), widen(v, q))
    return m_new, l_i, acc


@triton.jit
def alibi_bias(slope, k_pos, q_pos):
    """ALiBi's scores bias in base 2: slope [M] (already times log2(e)) times key position [N] minus query
    position [M] (or a scalar); BLOOM's slope * key position differs by a constant per row, which the softmax
    cancels."""
    return slope[:, None] * (k_pos[None, :] - q_pos).to(tl.float32)


@triton.jit
def load_sink(sinks_ptr, head, ok):
    """The sink logits of q heads `head` (ok False: -inf, no sink), fp32 in base 2 like the scores."""
    return tl.load(sinks_ptr + head, mask=ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634  # log2(e)


@triton.jit
def fold_sink(m_i, l_i, acc, sink):
    """An attention sink (GPT-OSS): one more logit per q head, `sink` [M] fp32 in base 2 (-inf: none), in the
    softmax's denominator and attached to no value, folded into the online state once every key has been seen:
    a last "tile" of one key whose value is zero. Returns (l_i, acc) at the new max; acc / l_i is then the
    output, softmax over [scores, sink] with the sink's column dropped (transformers' eager attention)."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


# Host ints that change from step to step (the block table's width, the split count) are not specialised on:
# Triton would compile another variant whenever one of them became divisible by 16, inside a user's run (the
# start-up warm-up cannot meet every width). The strides that do not vary stay specialised.


@triton.jit
def combine_splits(out_ptr, part_acc_ptr, part_ml_ptr, row, out_offset, num_splits, SPLITS_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CG: tl.constexpr, sink, SINK: tl.constexpr):
    """One (sequence, q head) `row` of a split decode: every split's partial rescaled to the global max, summed
    and normalised, stored at out_ptr + out_offset. Partials [rows, num_splits, D] / [rows, num_splits, 2] fp32;
    split 0 is never empty, so the max is finite. CG: load the partials from L2 (".cg": written by other
    programs of the same launch, the fused reduce). SINK: the row's attention sink `sink` (fp32, base 2) joins
    the denominator here, once (the splits' partials carry none)."""
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    part = row * num_splits + offs_s  # [S]
    if CG:
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                      other=0.0, cache_modifier=".cg")
    else:
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                      other=0.0)
    if SINK:
        top = tl.maximum(tl.max(m, 0), sink)
        w = tl.exp2(m - top)  # [S]
        out = tl.sum(acc * w[:, None], 0) / (tl.sum(l * w, 0) + tl.exp2(sink - top))
    else:
        w = tl.exp2(m - tl.max(m, 0))  # [S]
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + out_offset + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)
