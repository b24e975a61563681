"""Rounding of fp32 values to the model dtype inside a kernel, as torch rounds after each bf16/fp16 op."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Dtype codes the kernels take as a constexpr (torch dtype -> code); 0 means no rounding (fp32).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


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


def dtype_code(dtype: torch.dtype, name: str) -> int:
    """The constexpr code of a supported float dtype; ValueError naming the argument otherwise."""
    if dtype not in DTYPE_CODES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {dtype}")
    return DTYPE_CODES[dtype]
