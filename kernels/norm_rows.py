"""What the row-norm kernels (kernels/rms_norm.py, kernels/layer_norm.py) share: the checks of x and the residual
and the output buffers on the host, and the row load with the residual add in the kernel."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .rounding import round_to


class NormRows(NamedTuple):
    """A norm launch's tensors: x and the residual as [T, N] row views (rows = x's when there is no residual: not
    read), the normed output, and the new residual's buffer (None without a residual); outputs are fresh and
    contiguous, sized from shapes only (CUDA-graph safe)."""

    x: torch.Tensor
    residual: torch.Tensor
    out: torch.Tensor
    res_out: torch.Tensor | None


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None) -> NormRows:
    """ValueError unless x [..., N] and the residual (like x) have unit last-dim strides."""
    if x.dim() < 1 or x.stride(-1) != 1:
        raise ValueError(f"x must have a unit last-dim stride, got shape {tuple(x.shape)} strides {x.stride()}")
    x2 = x.reshape(-1, x.shape[-1])  # a view for the usual [T, N] rows
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        return NormRows(x2, x2, out, None)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)} on {x.device}), got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")
    if residual.stride(-1) != 1:
        raise ValueError("residual must have a unit last-dim stride")
    return NormRows(x2, residual.reshape(-1, x.shape[-1]), out, torch.empty(x.shape, dtype=x.dtype, device=x.device))


@triton.jit
def load_row(x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_r, N, offs, ok, HAS_RESIDUAL: tl.constexpr,
             DTYPE: tl.constexpr):
    """Row `row` of x in fp32 (masked tail 0); with a residual, x + residual rounded to the model dtype (torch's
    `x + residual`), also stored as the row of the new residual (contiguous, N wide)."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = add_residual(x, res_ptr, res_out_ptr, row, stride_r, N, offs, ok, DTYPE)
    return x


@triton.jit
def add_residual(x, res_ptr, res_out_ptr, row, stride_r, N, offs, ok, DTYPE: tl.constexpr):
    """x [BLOCK] fp32 + the residual's row, rounded to the model dtype (torch's `x + residual`), stored as the row
    of the new residual and returned."""
    r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
    x = round_to(x + r, DTYPE)
    tl.store(res_out_ptr + row * N + offs, x.to(res_out_ptr.dtype.element_ty), mask=ok)
    return x
