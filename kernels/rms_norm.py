"""RMSNorm, optionally fused with the residual add before it (and with a first norm of x before that add: Gemma 2's
and GLM-4's norm after a sub-block, then the residual add, then the next sub-block's norm): one Triton program per
token row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_rows import add_residual, load_row, norm_rows
from .rounding import dtype_code, round_to


@triton.jit
def weigh(y, w, WEIGHT_FP32: tl.constexpr, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """An RMSNorm's weight step, in `rms_norm_torch`'s three orders: y the fp32 normed values, w the fp32 weight
    (broadcastable) -> the output, fp32 values exact in the model dtype. Also the per-head q/k norms' (rotary.py)."""
    if UNIT_OFFSET:
        w = 1.0 + w  # exact in fp32 for a bf16/fp16 weight, HF's (1.0 + weight.float())
    if WEIGHT_FP32:
        return round_to(w * y, DTYPE)  # (weight * normed32).to(x.dtype)
    return round_to(w * round_to(y, DTYPE), DTYPE)  # normed32.to(x.dtype), then weight * it, rounded


@triton.jit
def _normed(x, w_ptr, offs, ok, N, eps, WEIGHT_FP32: tl.constexpr, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """One row's RMSNorm: x [BLOCK] fp32 (masked tail 0) -> the normed row, fp32 values exact in the model dtype."""
    var = tl.sum(x * x, 0) / N  # masked tail loads 0: adds nothing
    y = x * tl.rsqrt(var + eps)  # x32 * rsqrt(mean + eps)
    return weigh(y, tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32), WEIGHT_FP32, UNIT_OFFSET, DTYPE)


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
    first_w_ptr,  # [N] the weight of the norm x gets before the residual add (FIRST_NORM only)
    first_eps,  # its epsilon (FIRST_NORM only)
    HAS_RESIDUAL: tl.constexpr,
    WEIGHT_FP32: tl.constexpr,  # OLMo2's order: the weight times the fp32 normed row, then one rounding
    UNIT_OFFSET: tl.constexpr,  # Gemma's (1 + weight) in fp32 (WEIGHT_FP32's order)
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row lives in one program
    FIRST_NORM: tl.constexpr = False,  # (HAS_RESIDUAL) x normed first, in the same order, then added, then normed
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    if FIRST_NORM:  # the first norm's output rounded, as its own launch would store it, then the add
        x = load_row(x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_r, N, offs, ok, False, DTYPE)
        x = _normed(x, first_w_ptr, offs, ok, N, first_eps, WEIGHT_FP32, UNIT_OFFSET, DTYPE)
        x = add_residual(x, res_ptr, res_out_ptr, row, stride_r, N, offs, ok, DTYPE)
    else:
        x = load_row(x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_r, N, offs, ok, HAS_RESIDUAL, DTYPE)
    y = _normed(x, w_ptr, offs, ok, N, eps, WEIGHT_FP32, UNIT_OFFSET, DTYPE)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    weight_in_fp32: bool = False, unit_offset: bool = False, first_weight: torch.Tensor | None = None,
    first_eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm over the last dim. x [..., N] (unit last-dim stride), weight [N] in x's dtype.
    weight_in_fp32: OLMo2's order (the weight multiplies the fp32 normed row before the one cast); unit_offset:
    Gemma's (1 + weight) in fp32, in that order.

    Without residual returns normed [..., N]; with residual [..., N] returns (normed, x + residual), both
    fresh contiguous buffers (sizes from shapes only: CUDA-graph safe). first_weight [N] (with a residual): x is
    first RMS-normed by it (first_eps, the same order), and that norm's output is what the residual gets added:
    (normed, first_norm(x) + residual), bit for bit a launch of the first norm then this one with a residual.
    Numerics: `rms_norm_torch`'s."""
    code = dtype_code(x.dtype, "x")
    x2, r2, out, res_out = norm_rows(x, residual)
    hidden = x.shape[-1]
    if weight.dtype != x.dtype or tuple(weight.shape) != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {x.dtype} [{hidden}], got {weight.dtype} {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    if first_weight is not None and (residual is None or first_weight.dtype != weight.dtype
                                     or first_weight.shape != weight.shape or first_weight.device != x.device
                                     or not first_weight.is_contiguous()):
        raise ValueError("first_weight needs a residual and must be like weight (contiguous, same dtype, shape "
                         "and device)")
    rows = x2.shape[0]
    if rows and hidden:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            out, out if res_out is None else res_out, x2, r2, weight,
            x2.stride(0), r2.stride(0), hidden, eps, weight if first_weight is None else first_weight, first_eps,
            HAS_RESIDUAL=residual is not None, WEIGHT_FP32=weight_in_fp32 or unit_offset, UNIT_OFFSET=unit_offset,
            DTYPE=code, BLOCK=block, FIRST_NORM=first_weight is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    weight_in_fp32: bool = False, unit_offset: bool = False, first_weight: torch.Tensor | None = None,
    first_eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (the engine's CPU path): x / rms(x) in fp32, cast back, times weight (as HF's Llama);
    weight_in_fp32: the weight times the fp32 row, then cast (HF's OLMo2); unit_offset: (1 + weight) in fp32 times
    the fp32 row, then cast (HF's Gemma). With residual: the add in the model dtype first (HF's `residual + h`);
    returns (normed, x + residual). first_weight: x normed by it first (rms_norm_triton's)."""
    if first_weight is not None:
        if residual is None:
            raise ValueError("first_weight needs a residual")
        x = rms_norm_torch(x, first_weight, first_eps, weight_in_fp32=weight_in_fp32, unit_offset=unit_offset)
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
