"""Writing one step's K and V into the paged KV cache: one Triton launch for both, cast to the cache dtype (the
model's, or an fp8 format: EngineConfig.kv_cache_dtype, saturating at the format's largest value, scale 1)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, wait_for_predecessor
from .rounding import FP8_MAX, cache_codes, dtype_code, fp8_code, round_to_cache


@triton.jit
def _write_kv_cache_kernel(
    kv_ptr,  # [2, num_blocks, block_size, Hkv, D] contiguous; index 0 = K, 1 = V
    k_ptr,  # [T, Hkv, D] unit last-dim stride
    v_ptr,  # [T, Hkv, D] unit last-dim stride
    slot_ptr,  # [T] int64 flat slot (block * block_size + offset) per token
    stride_kt, stride_kh,  # k strides (elements) between tokens, heads
    stride_vt, stride_vh,  # v strides
    stride_kv,  # elements between the K and V halves of the cache
    H,  # Hkv
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of the cache dtype (when not FP8)
    FP8: tl.constexpr,  # rounding.FP8_CODES code of an fp8 cache, 0 otherwise
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,  # next powers of two of H and HEAD_DIM
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py)
):
    # One program per token: its K row and V row ([Hkv, D] each) go to the same slot of both halves.
    wait_for_predecessor(PDL)
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok)
    heads = tl.arange(0, H_PAD)
    offs = tl.arange(0, D_PAD)
    ok = (heads < H)[:, None] & (offs < HEAD_DIM)[None, :]
    dst = kv_ptr + slot * (H * HEAD_DIM) + heads[:, None] * HEAD_DIM + offs[None, :]
    k = tl.load(k_ptr + tok * stride_kt + heads[:, None] * stride_kh + offs[None, :], mask=ok, other=0.0)
    v = tl.load(v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs[None, :], mask=ok, other=0.0)
    # .to(cache dtype) rounds to nearest even; a value already in the cache dtype passes unchanged.
    k = round_to_cache(k.to(tl.float32), DTYPE, FP8)
    v = round_to_cache(v.to(tl.float32), DTYPE, FP8)
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=ok)


def check_kv_write(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Validates a Triton KV-cache write's arguments (here, and the write fused into kernels/rotary.py, which gives
    k before its rotation: same shape and layout); raises ValueError naming the offending one."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
    want = (kv_cache.shape[3], kv_cache.shape[4])
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"{name} must be [{slot_mapping.shape[0]}, {want[0]}, {want[1]}] (one row per "
                             f"slot_mapping entry), got {tuple(t.shape)}")
        dtype_code(t.dtype, name)
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device} but kv_cache is on {kv_cache.device}")
    cache_codes(kv_cache.dtype)  # the model's dtypes or fp8, else a ValueError
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 or slot_mapping.device != kv_cache.device:
        raise ValueError(f"slot_mapping must be int64 [T] on {kv_cache.device}, got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)} on {slot_mapping.device}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if k.stride(2) != 1 or v.stride(2) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("k and v need a unit last-dim stride and slot_mapping must be contiguous")


def write_kv_cache_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Triton: kv_cache[0/1] at slot_mapping[t] = k[t]/v[t] cast to the cache dtype, one launch for both.

    kv_cache [2, num_blocks, block_size, Hkv, D] contiguous; k, v [T, Hkv, D] with unit last-dim stride
    (views of the qkv projection are fine); slot_mapping [T] int64, every slot < num_blocks * block_size
    (not checked: that would need a host sync). Numerics: `write_kv_cache_torch`'s (bit-exact: one cast)."""
    check_kv_write(kv_cache, k, v, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    dtype, fp8 = cache_codes(kv_cache.dtype)
    _write_kv_cache_kernel[(num_tokens,)](
        kv_cache, k, v, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_cache.stride(0), num_kv_heads,
        DTYPE=dtype, FP8=fp8, HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim), num_warps=4,
        **pdl_options(kv_cache.device),
    )


def write_kv_cache_torch(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """Plain-torch reference (the engine's CPU path): two `index_copy_` of k and v cast to the cache dtype (an fp8
    cache: clamped to the format's largest value first, then cast; copied as bytes, torch has no fp8 index_copy_
    on CPU). kv_cache [2, num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D]; slot_mapping [T] int64 flat slots."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if fp8_code(kv_cache.dtype):
        limit = FP8_MAX[kv_cache.dtype]
        k, v = (t.float().clamp(-limit, limit).to(kv_cache.dtype).view(torch.uint8) for t in (k, v))
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))
