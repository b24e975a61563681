"""Rotary embedding (neox / rotate_half) of q and k, with Qwen3's per-head RMSNorm fused in front and, on the engine's
fused path, the KV-cache write of the step's K and V fused behind (KVWrite)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .kv_cache_write import check_kv_write
from .pdl import pdl_options, wait_for_predecessor
from .rms_norm import rms_norm_torch, weigh
from .rounding import cache_codes, dtype_code, round_to, round_to_cache


@triton.jit
def _norm_rope_heads(
    in_ptr,  # [T, H, HEAD_DIM] with unit last-dim stride
    w_ptr,  # [HEAD_DIM] per-head norm weight (NORM only)
    tok,  # this program's token (int64)
    cos, sin,  # [HALF_PAD] fp32, rounded to the model dtype unless TABLES_FP32
    stride_t, stride_h,  # input strides (elements) between tokens, heads
    H, eps,
    NORM: tl.constexpr, DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr, PASS_PAD: tl.constexpr, ROPE_FP32: tl.constexpr,
    NORM_WEIGHT_FP32: tl.constexpr, NORM_UNIT_OFFSET: tl.constexpr,
):
    """All H heads of one token: optional RMSNorm over each whole head, then the rotation of its rotary pairs.
    Returns the pairs' rotated first and second elements [H_PAD, HALF_PAD], their mask, and the head's
    pass-through tail [H_PAD, PASS_PAD] (normed, not rotated; PASS_PAD 0: the rotation covers the head), all fp32
    values exact in the model dtype."""
    heads = tl.arange(0, H_PAD)
    offs = tl.arange(0, HALF_PAD)
    ok = (heads < H)[:, None] & (offs < HALF)[None, :]  # [H_PAD, HALF_PAD]
    first, second = _pair_offsets(offs, HALF, INTERLEAVED)
    row = in_ptr + tok * stride_t + heads[:, None] * stride_h
    x1 = tl.load(row + first[None, :], mask=ok, other=0.0).to(tl.float32)  # each pair's first element
    x2 = tl.load(row + second[None, :], mask=ok, other=0.0).to(tl.float32)  # and its second
    x3 = tl.zeros([H_PAD, 1], tl.float32)
    if PASS_PAD > 0:
        tail = tl.arange(0, PASS_PAD)
        tail_ok = (heads < H)[:, None] & (tail < HEAD_DIM - 2 * HALF)[None, :]
        x3 = tl.load(row + 2 * HALF + tail[None, :], mask=tail_ok, other=0.0).to(tl.float32)
    if NORM:
        sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)  # [H_PAD] sum of squares per head
        if PASS_PAD > 0:
            sq += tl.sum(x3 * x3, 1)
        inv = tl.rsqrt(sq / HEAD_DIM + eps)[:, None]  # mean of squares over the whole head
        w1 = tl.load(w_ptr + first, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + second, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = weigh(x1 * inv, w1, NORM_WEIGHT_FP32, NORM_UNIT_OFFSET, DTYPE)  # the RMSNorm kernel's weight step
        x2 = weigh(x2 * inv, w2, NORM_WEIGHT_FP32, NORM_UNIT_OFFSET, DTYPE)
        if PASS_PAD > 0:
            w3 = tl.load(w_ptr + 2 * HALF + tail, mask=tail < HEAD_DIM - 2 * HALF, other=0.0).to(tl.float32)
            x3 = weigh(x3 * inv, w3[None, :], NORM_WEIGHT_FP32, NORM_UNIT_OFFSET, DTYPE)
    c = cos[None, :]
    s = sin[None, :]
    if ROPE_FP32:  # Cohere: products and sum in fp32, one rounding (HF's q.float() ... .to(q.dtype))
        o1 = round_to(x1 * c - x2 * s, DTYPE)
        o2 = round_to(x2 * c + x1 * s, DTYPE)
    else:  # each product and each sum rounds to the model dtype, as torch's bf16 `x1 * cos - x2 * sin`
        o1 = round_to(round_to(x1 * c, DTYPE) - round_to(x2 * s, DTYPE), DTYPE)
        o2 = round_to(round_to(x2 * c, DTYPE) + round_to(x1 * s, DTYPE), DTYPE)
    return o1, o2, ok, x3


@triton.jit
def _pair_offsets(offs, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Where rotary pair i's two elements sit in a head: (i, i + HALF) for neox / rotate_half, (2i, 2i + 1) for
    the interleaved (GPT-J / GLM) form. Either way the first 2 * HALF elements rotate, the rest pass through."""
    if INTERLEAVED:
        return offs * 2, offs * 2 + 1
    return offs, offs + HALF


@triton.jit
def _qk_norm_rope_kernel(
    q_out_ptr,  # [T, Hq * D] contiguous, q's dtype
    k_out_ptr,  # [T, Hkv * D] contiguous (not written with CACHE)
    q_ptr,  # [T, Hq, D] unit last-dim stride (e.g. a column slice of the qkv projection)
    k_ptr,  # [T, Hkv, D] unit last-dim stride
    q_w_ptr,  # [D] q norm weight (NORM only)
    k_w_ptr,  # [D] k norm weight (NORM only)
    pos_ptr,  # [T] int64 positions
    cos_ptr,  # [P, HALF] fp32 contiguous cos cache (HALF = rotary_dim / 2)
    sin_ptr,  # [P, HALF] fp32 contiguous sin cache
    kv_ptr,  # CACHE: [2, num_blocks, block_size, Hkv, D] contiguous KV cache (index 0 = K, 1 = V)
    v_ptr,  # CACHE: [T, Hkv, D] unit last-dim stride
    slot_ptr,  # CACHE: [T] int64 flat slot per token
    stride_qt, stride_qh,  # q strides (elements) between tokens, heads
    stride_kt, stride_kh,  # k strides
    stride_vt, stride_vh,  # v strides (CACHE)
    stride_kv,  # elements between the K and V halves of the cache (CACHE)
    Hq, Hkv, eps,
    NORM: tl.constexpr,  # per-head RMSNorm before the rotation (Qwen3)
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of q's dtype
    HEAD_DIM: tl.constexpr,
    HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,  # next powers of two of the head counts
    HALF: tl.constexpr,  # rotary pairs per head (rotary_dim / 2; HEAD_DIM / 2 for a full rotary)
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i + 1) (GPT-J / GLM) instead of (i, i + HALF) (neox)
    PASS_PAD: tl.constexpr,  # next power of two >= HEAD_DIM - 2 * HALF, the unrotated tail; 0 without one
    CACHE: tl.constexpr,  # write the rotated K and V into the KV cache at slot_ptr[t] instead of k_out
    KV_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,  # the cache's DTYPE_CODES / FP8_CODES code (CACHE)
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py)
    ROPE_FP32: tl.constexpr = False,  # the rotation's products and sums in fp32, one rounding (Cohere)
    TABLES_FP32: tl.constexpr = False,  # cos/sin unrounded too (ROPE_FP32 only: DeepSeek-V2's, Ernie 4.5's)
    NORM_WEIGHT_FP32: tl.constexpr = False,  # NORM: OLMo 2's weight step (the weight times the fp32 row, one cast)
    NORM_UNIT_OFFSET: tl.constexpr = False,  # NORM: Gemma's (1 + weight) in fp32 (with NORM_WEIGHT_FP32)
):
    # Grid (T, 2): program (t, 0) does every q head of token t, (t, 1) every k head (and with CACHE its K and V
    # rows into the cache, as write_kv_cache_triton would: one launch and no k_out round trip).
    wait_for_predecessor(PDL)
    tok = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    offs = tl.arange(0, HALF_PAD)
    first, second = _pair_offsets(offs, HALF, INTERLEAVED)
    pos = tl.load(pos_ptr + tok)
    cos = tl.load(cos_ptr + pos * HALF + offs, mask=offs < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + offs, mask=offs < HALF, other=0.0)
    if not TABLES_FP32:  # .to(q.dtype)
        cos = round_to(cos, DTYPE)
        sin = round_to(sin, DTYPE)
    # The two branches name their values apart: Triton types a name across a runtime branch (shapes differ here).
    if which == 0:
        q1, q2, q_ok, q3 = _norm_rope_heads(q_ptr, q_w_ptr, tok, cos, sin, stride_qt, stride_qh, Hq, eps,
                                            NORM, DTYPE, HEAD_DIM, HQ_PAD, HALF, HALF_PAD, INTERLEAVED, PASS_PAD,
                                            ROPE_FP32, NORM_WEIGHT_FP32, NORM_UNIT_OFFSET)
        q_row = q_out_ptr + tok * (Hq * HEAD_DIM) + tl.arange(0, HQ_PAD)[:, None] * HEAD_DIM
        q_ty = q_out_ptr.dtype.element_ty
        tl.store(q_row + first[None, :], q1.to(q_ty), mask=q_ok)
        tl.store(q_row + second[None, :], q2.to(q_ty), mask=q_ok)
        if PASS_PAD > 0:
            tail = tl.arange(0, PASS_PAD)
            q_tail_ok = (tl.arange(0, HQ_PAD) < Hq)[:, None] & (tail < HEAD_DIM - 2 * HALF)[None, :]
            tl.store(q_row + 2 * HALF + tail[None, :], q3.to(q_ty), mask=q_tail_ok)
    else:
        k1, k2, k_ok, k3 = _norm_rope_heads(k_ptr, k_w_ptr, tok, cos, sin, stride_kt, stride_kh, Hkv, eps,
                                            NORM, DTYPE, HEAD_DIM, HKV_PAD, HALF, HALF_PAD, INTERLEAVED, PASS_PAD,
                                            ROPE_FP32, NORM_WEIGHT_FP32, NORM_UNIT_OFFSET)
        kv_heads = tl.arange(0, HKV_PAD)
        tail = tl.arange(0, PASS_PAD if PASS_PAD > 0 else 1)  # [PASS_PAD] (used only with a tail)
        k_tail_ok = (kv_heads < Hkv)[:, None] & (tail < HEAD_DIM - 2 * HALF)[None, :]
        row = kv_heads[:, None] * HEAD_DIM  # [HKV_PAD, 1]: each head's start within a token's [Hkv * D]
        if CACHE:
            ty = kv_ptr.dtype.element_ty
            c_row = kv_ptr + tl.load(slot_ptr + tok) * (Hkv * HEAD_DIM) + row
            tl.store(c_row + first[None, :], round_to_cache(k1, KV_DTYPE, KV_FP8).to(ty), mask=k_ok)
            tl.store(c_row + second[None, :], round_to_cache(k2, KV_DTYPE, KV_FP8).to(ty), mask=k_ok)
            # V goes through unchanged: the same three pieces of each head, pairs and tail.
            v_row = v_ptr + tok * stride_vt + kv_heads[:, None] * stride_vh
            v1 = tl.load(v_row + first[None, :], mask=k_ok, other=0.0).to(tl.float32)
            v2 = tl.load(v_row + second[None, :], mask=k_ok, other=0.0).to(tl.float32)
            tl.store(c_row + stride_kv + first[None, :], round_to_cache(v1, KV_DTYPE, KV_FP8).to(ty), mask=k_ok)
            tl.store(c_row + stride_kv + second[None, :], round_to_cache(v2, KV_DTYPE, KV_FP8).to(ty), mask=k_ok)
            if PASS_PAD > 0:
                tail_at = 2 * HALF + tail[None, :]
                tl.store(c_row + tail_at, round_to_cache(k3, KV_DTYPE, KV_FP8).to(ty), mask=k_tail_ok)
                v3 = tl.load(v_row + tail_at, mask=k_tail_ok, other=0.0).to(tl.float32)
                tl.store(c_row + stride_kv + tail_at, round_to_cache(v3, KV_DTYPE, KV_FP8).to(ty), mask=k_tail_ok)
        else:
            k_row = k_out_ptr + tok * (Hkv * HEAD_DIM) + row
            k_ty = k_out_ptr.dtype.element_ty
            tl.store(k_row + first[None, :], k1.to(k_ty), mask=k_ok)
            tl.store(k_row + second[None, :], k2.to(k_ty), mask=k_ok)
            if PASS_PAD > 0:
                tl.store(k_row + 2 * HALF + tail[None, :], k3.to(k_ty), mask=k_tail_ok)


def _check(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, fp32_math=False, fp32_tables=False) -> None:
    """Validates the arguments of both implementations; raises ValueError naming the offending one."""
    if fp32_tables and not fp32_math:
        raise ValueError("fp32_tables (unrounded cos/sin) needs fp32_math (the rotation in fp32)")
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"expected q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    dtype_code(q.dtype, "q")
    if k.dtype != q.dtype:
        raise ValueError(f"k must be {q.dtype} like q, got {k.dtype}")
    head_dim = q.shape[2]
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.dtype != torch.int64 or tuple(positions.shape) != (q.shape[0],):
        raise ValueError(f"positions must be int64 [{q.shape[0]}], got {positions.dtype} {tuple(positions.shape)}")
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if (c.dtype != torch.float32 or c.dim() != 2 or not 1 <= c.shape[1] <= head_dim // 2
                or c.shape != cos_cache.shape or not c.is_contiguous()):
            raise ValueError(f"{name} must be contiguous float32 [P, rotary_dim / 2] with rotary_dim <= "
                             f"head_dim={head_dim} (cos and sin alike), got {c.dtype} {tuple(c.shape)}")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must be given together (q/k norm) or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.dtype != q.dtype or tuple(w.shape) != (head_dim,) or not w.is_contiguous()):
            raise ValueError(f"{name} must be contiguous {q.dtype} [{head_dim}], got {w.dtype} {tuple(w.shape)}")
    for name, t in (("k", k), ("positions", positions), ("cos_cache", cos_cache), ("sin_cache", sin_cache),
                    ("q_weight", q_weight), ("k_weight", k_weight)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


@dataclass(frozen=True)
class KVWrite:
    """Where a fused q/k norm + rope also writes the step's K (rotated) and V: a layer's KV cache [2, num_blocks,
    block_size, Hkv, D] (contiguous; the model's dtype or fp8), v [T, Hkv, D] (unit last-dim stride) and
    slot_mapping [T] int64, as `write_kv_cache_triton` takes them."""

    kv_cache: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor


def qk_norm_rope_triton(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
    kv_write: KVWrite | None = None, interleaved: bool = False, fp32_math: bool = False, fp32_tables: bool = False,
    norm_weight_in_fp32: bool = False, norm_unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton: optional per-head RMSNorm (q_weight/k_weight [D]) then rotary, one launch for q and k.

    positions [T] int64; q [T, Hq, D], k [T, Hkv, D] with unit last-dim stride (column slices of the qkv
    projection are fine); cos_cache/sin_cache [P, R/2] fp32, R the rotary width: the first R elements of each
    head rotate (pairs (i, i + R/2), or (2i, 2i + 1) when `interleaved`), the other D - R pass through (normed
    with the rest of the head where there is a norm). Returns fresh contiguous q [T, Hq*D] and
    k [T, Hkv*D] in q's dtype. With `kv_write` the rotated K and V go into the KV cache instead (bit for bit what
    `write_kv_cache_triton` of the returned k would store) and k is returned as None. The norm's weight step
    follows `rms_norm_torch`'s flags (norm_weight_in_fp32: OLMo 2's order; norm_unit_offset: Gemma's (1 + weight)).
    Numerics: `qk_norm_rope_torch`'s. Positions must be < P (not checked: a sync)."""
    _check(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, fp32_math, fp32_tables)
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must have a unit last-dim stride")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((num_tokens, num_heads * head_dim), dtype=q.dtype, device=q.device)
    cache = kv_write is not None
    if cache:
        check_kv_write(kv_write.kv_cache, k, kv_write.v, kv_write.slot_mapping)
        kv, v, slots = kv_write.kv_cache, kv_write.v, kv_write.slot_mapping
        k_out = None
    else:
        k_out = torch.empty((num_tokens, num_kv_heads * head_dim), dtype=q.dtype, device=q.device)
        kv, v, slots = q_out, k, positions  # not touched without CACHE
    if num_tokens == 0:
        return q_out, k_out
    norm = q_weight is not None
    half = cos_cache.shape[1]
    kv_dtype, kv_fp8 = cache_codes(kv.dtype) if cache else (0, 0)
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q_out, k_out if k_out is not None else q_out, q, k,
        q_weight if norm else q, k_weight if norm else k,  # not read without NORM
        positions, cos_cache, sin_cache, kv, v, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0) if cache else 0,
        num_heads, num_kv_heads, eps,
        NORM=norm, DTYPE=dtype_code(q.dtype, "q"), HEAD_DIM=head_dim,
        HQ_PAD=triton.next_power_of_2(num_heads), HKV_PAD=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), INTERLEAVED=bool(interleaved),
        PASS_PAD=triton.next_power_of_2(head_dim - 2 * half) if head_dim > 2 * half else 0, CACHE=cache,
        KV_DTYPE=kv_dtype, KV_FP8=kv_fp8, ROPE_FP32=bool(fp32_math), TABLES_FP32=bool(fp32_tables),
        NORM_WEIGHT_FP32=norm and (norm_weight_in_fp32 or norm_unit_offset), NORM_UNIT_OFFSET=norm and norm_unit_offset,
        num_warps=4, **pdl_options(q.device),
    )
    return q_out, k_out


def rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 fp32_math: bool = False) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, 1, R/2] in x's dtype. Each pair (x1, x2) of the first R elements -> (x1 cos - x2 sin,
    x2 cos + x1 sin), the rest unchanged == HF's `q_rot * cos + rotate_half(q_rot) * sin` then `cat(q_embed,
    q_pass)`, with the same per-element rounding. Pairs: (i, i + R/2) (neox), or (2i, 2i + 1) when `interleaved`
    (GLM's and GPT-J's rotate_half over repeat_interleave'd cos/sin). fp32_math: x and the cos/sin upcast, the
    products and sums in fp32, one rounding back to x's dtype (Cohere's apply_rotary_pos_emb)."""
    if fp32_math and x.dtype != torch.float32:
        return rotate_torch(x.float(), cos.float(), sin.float(), interleaved).to(x.dtype)
    rot_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def qk_norm_rope_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 1e-6,
    interleaved: bool = False, fp32_math: bool = False, fp32_tables: bool = False,
    norm_weight_in_fp32: bool = False, norm_unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `qk_norm_rope_triton` (same arguments): `rms_norm_torch` per head, then
    `rotate_torch` with cos/sin gathered at positions and cast to q's dtype (kept in fp32 with `fp32_tables`, which
    needs fp32_math: DeepSeek-V2's and Ernie 4.5's rotation, HF's fp32 cos/sin times the upcast q). Returns
    q [T, Hq*D], k [T, Hkv*D]."""
    _check(q, k, positions, cos_cache, sin_cache, q_weight, k_weight, fp32_math, fp32_tables)
    num_tokens = q.shape[0]
    if q_weight is not None:
        q = rms_norm_torch(q, q_weight, eps, weight_in_fp32=norm_weight_in_fp32, unit_offset=norm_unit_offset)
        k = rms_norm_torch(k, k_weight, eps, weight_in_fp32=norm_weight_in_fp32, unit_offset=norm_unit_offset)
    cos, sin = cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1)  # [T, 1, R/2] fp32
    if not fp32_tables:
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return (rotate_torch(q, cos, sin, interleaved, fp32_math).reshape(num_tokens, -1),
            rotate_torch(k, cos, sin, interleaved, fp32_math).reshape(num_tokens, -1))
