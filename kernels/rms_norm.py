"""RMSNorm, optionally fused with the residual add before it: one Triton program per token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_rows import load_row, norm_rows
from .rounding import dtype_code, round_to


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, N] x's dtype, contiguous: the normed rows
    res_out_ptr,  # [T, N] x's dtype, contiguous: x + residual, the new residual (HAS_RESIDUAL only)
    x_ptr,  # [T, N], unit column stride
    res_ptr,  # [T, N] residual (HAS_RESIDUAL only), unit column stride
    w_ptr,  # [N] weight, x's dtype
    stride_x,  # elements between two rows of x
    stride_r,  # elements between two rows of residual
    N,  # hidden size
    eps,
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,  # OLMo2's order: the weight times the fp32 normed row, then one rounding
    UNIT_OFFSET: tl.constexpr,  # Gemma's (1 + weight) in fp32 (WEIGHT_FP32's order)
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row lives in one program
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_r, N, offs, ok, HAS_RESIDUAL, DTYPE)
    var = tl.sum(x * x, 0) / N  # masked tail loads 0: adds nothing
    y = x * tl.rsqrt(var + eps)  # x32 * rsqrt(mean + eps)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = 1.0 + w  # exact in fp32 for a bf16/fp16 weight, HF's (1.0 + weight.float())
    if WEIGHT_FP32:
        y = round_to(w * y, DTYPE)  # (weight * normed32).to(x.dtype)
    else:
        y = round_to(w * round_to(y, DTYPE), DTYPE)  # normed32.to(x.dtype), then weight * it, rounded
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    weight_in_fp32: bool = False, unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm over the last dim. x [..., N] (unit last-dim stride), weight [N] in x's dtype.
    weight_in_fp32: OLMo2's order (the weight multiplies the fp32 normed row before the one cast); unit_offset:
    Gemma's (1 + weight) in fp32, in that order.

    Without residual returns normed [..., N]; with residual [..., N] returns (normed, x + residual), both
    fresh contiguous buffers (sizes from shapes only: CUDA-graph safe). Numerics: `rms_norm_torch`'s."""
    code = dtype_code(x.dtype, "x")
    x2, r2, out, res_out = norm_rows(x, residual)
    hidden = x.shape[-1]
    if weight.dtype != x.dtype or tuple(weight.shape) != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {x.dtype} [{hidden}], got {weight.dtype} {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    rows = x2.shape[0]
    if rows and hidden:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out, out if res_out is None else res_out, x2, r2, weight,
            x2.stride(0), r2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, WEIGHT_FP32=weight_in_fp32 or unit_offset, UNIT_OFFSET=unit_offset,
            DTYPE=code, BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    weight_in_fp32: bool = False, unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (the engine's CPU path): x / rms(x) in fp32, cast back, times weight (as HF's Llama);
    weight_in_fp32: the weight times the fp32 row, then cast (HF's OLMo2); unit_offset: (1 + weight) in fp32 times
    the fp32 row, then cast (HF's Gemma). With residual: the add in the model dtype first (HF's `residual + h`);
    returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        return rms_norm_torch(x, weight, eps, weight_in_fp32=weight_in_fp32, unit_offset=unit_offset), x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    if weight_in_fp32:
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)
