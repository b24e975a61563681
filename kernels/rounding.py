"""Rounding of fp32 values to the model dtype inside a kernel, as torch rounds after each bf16/fp16 op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Dtype codes the kernels take as a constexpr (torch dtype -> code); 0 means no rounding (fp32).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# fp8 KV-cache dtypes (EngineConfig.kv_cache_dtype) -> the code `round_to_fp8` takes; 0 = not fp8.
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# Largest finite value of each fp8 format: a value beyond it is stored as it (saturation, not inf or NaN).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x -> the nearest value of DTYPE (a DTYPE_CODES code), ties to even, returned as fp32.

    bf16 is rounded with integer arithmetic on the fp32 bits rather than `.to(tl.bfloat16)`: the Triton
    interpreter's fp32 -> bf16 conversion truncates, and this way the compiled kernel and the interpreter
    round identically. A rounded value is exact in DTYPE, so storing it through a DTYPE pointer is exact
    too (even under the interpreter's truncating store)."""
    if DTYPE == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even at bit 16
        y = bits.to(tl.float32, bitcast=True)
    elif DTYPE == 2:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def round_to_fp8(x, FP8: tl.constexpr):
    """fp32 x -> the nearest value of an fp8 format (FP8_CODES: 1 = e4m3fn, 2 = e5m2), ties to even, saturated to
    +-its largest finite value, returned as fp32 (NaN stays NaN, the sign of zero is kept).

    torch's `x.clamp(-max, max).to(float8)`, bit for bit. Rounded with fp32 arithmetic rather than `.to(fp8)`:
    the Triton interpreter's fp32 -> fp8 conversion rounds wrongly and saturates at 256 for e4m3 (measured), while
    it converts a value already exact in the format correctly, as the GPU does."""
    if FP8 == 1:  # e4m3fn: 3 mantissa bits, normals from 2^-6, subnormals in steps of 2^-9
        SHIFT: tl.constexpr = 20
        MIN_NORMAL: tl.constexpr = 0.015625
        MAGIC: tl.constexpr = 16384.0  # 2^14: its fp32 ulp is 2^-9, the subnormal step
        MAX: tl.constexpr = 448.0
    else:  # e5m2: 2 mantissa bits, normals from 2^-14, subnormals in steps of 2^-16
        SHIFT: tl.constexpr = 21
        MIN_NORMAL: tl.constexpr = 6.103515625e-05
        MAGIC: tl.constexpr = 128.0  # 2^7: ulp 2^-16
        MAX: tl.constexpr = 57344.0
    bits = x.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF  # |x|
    # Normal range: round the fp32 mantissa to the format's bits, ties to even (a carry moves up an exponent).
    mag = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) << SHIFT
    normal = mag.to(tl.float32, bitcast=True)
    a = tl.abs(x)
    sub = (a + MAGIC) - MAGIC  # subnormal range: the fp32 add rounds a to a multiple of the step, ties to even
    r = tl.minimum(tl.where(a < MIN_NORMAL, sub, normal), MAX)
    r = tl.where((bits >> 31) != 0, -r, r)
    return tl.where(x != x, x, r)


@triton.jit
def round_to_cache(x, DTYPE: tl.constexpr, FP8: tl.constexpr):
    """fp32 x -> the KV cache's values, still fp32: `round_to_fp8` for an fp8 cache (FP8 != 0), else `round_to` its
    DTYPE. `cache_codes` gives both codes of a cache dtype."""
    if FP8:
        return round_to_fp8(x, FP8)
    return round_to(x, DTYPE)


def dtype_code(dtype: torch.dtype, name: str) -> int:
    """The constexpr code of a supported float dtype; ValueError naming the argument otherwise."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dtype}")
    return DTYPE_CODES[dtype]


def fp8_code(dtype: torch.dtype) -> int:
    """`round_to_fp8`'s code of an fp8 dtype, 0 for any other."""
    return FP8_CODES.get(dtype, 0)


def cache_codes(dtype: torch.dtype) -> tuple[int, int]:
    """`round_to_cache`'s (DTYPE, FP8) codes of a KV cache dtype; ValueError for a dtype that is neither."""
    fp8 = fp8_code(dtype)
    return (0 if fp8 else dtype_code(dtype, "kv_cache")), fp8
