"""fp8 (e4m3) linear: per-output-channel weight scales, dynamic per-token activation scales; `torch._scaled_mm`
on CUDA (capability >= 8.9), an fp32 reference with the same numbers (up to accumulation order) elsewhere."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max; e4m3fn has no inf, so values past it must be clamped (else NaN)
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: first GPUs with fp8 tensor cores
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (and q = 0) instead of dividing by zero
# Row-wise scaled _scaled_mm writes bf16 or fp16 on every fp8 GPU (fp32 only through cuBLAS on sm90); an fp32
# model gets bf16 out of the GEMM, upcast. fp8's own error (~2^-4 relative) dwarfs that rounding (2^-9).
_SCALED_MM_OUT_DTYPES = (torch.bfloat16, torch.float16)


@torch.no_grad()
def quantize_fp8_per_row(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] float -> (q [R, C] e4m3, scale [R, 1] fp32) with t ≈ q * scale, scale = max|t_row| / 448.

    Used for weights (rows = output channels, once at load time) and activations (rows = tokens, every call).
    Computed in fp32; the cast to e4m3 rounds to nearest even."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)  # [R, 1]
    q = (t32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_matmul_reference(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """xq [T, K] e4m3, x_scale [T, 1] fp32, wq [N, K] e4m3, w_scale [1, N] fp32 -> [T, N] out_dtype.

    What _scaled_mm computes, in plain torch: an fp32 GEMM of the fp8 values (each product of two e4m3 numbers is
    exact in fp32), then both scales in the epilogue, then one rounding to out_dtype. Runs on any device."""
    acc = xq.float() @ wq.float().t()  # [T, N] fp32
    return (acc * x_scale * w_scale).to(out_dtype)


def fp8_matmul_scaled_mm(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Same contract as fp8_matmul_reference, on CUDA fp8 tensor cores. Needs K and N multiples of 16, xq
    row-major, wq^T column-major (wq [N, K] contiguous gives that), both scales contiguous fp32."""
    gemm_dtype = out_dtype if out_dtype in _SCALED_MM_OUT_DTYPES else torch.bfloat16
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=gemm_dtype)
    return y.to(out_dtype)


def scaled_mm_supported(weight: torch.Tensor) -> bool:
    """Whether _scaled_mm can run an [N, K] weight on its device: CUDA with capability >= 8.9 and N, K % 16 == 0."""
    if weight.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(weight.device) < MIN_CAPABILITY:
        return False
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8Linear(nn.Module):
    """Drop-in for layers.Linear. qweight [N, K] e4m3 and scale [1, N] fp32 from the float weight at load time;
    every forward quantizes x per token (dynamic scale [T, 1]), runs the fp8 GEMM, rescales, adds the bias in the
    model dtype. `use_scaled_mm` (fixed at construction) picks _scaled_mm or the reference path."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())  # [N, K] e4m3
        self.register_buffer("scale", scale.reshape(1, -1).contiguous())  # [1, N] fp32
        self.bias = bias  # [N] model dtype, or None
        self.use_scaled_mm = scaled_mm_supported(qweight)
        if qweight.device.type == "cuda" and not self.use_scaled_mm:
            logger.warning("fp8 linear [%d, %d] on %s runs the reference path (needs capability >= 8.9 and "
                           "dims divisible by 16)", self.out_features, self.in_features, qweight.device)

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Fp8Linear:
        q, scale = quantize_fp8_per_row(linear.weight)  # [N, K], [N, 1]
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_row(x.reshape(-1, self.in_features))  # [T, K] e4m3, [T, 1] fp32
        matmul = fp8_matmul_scaled_mm if self.use_scaled_mm else fp8_matmul_reference
        y = matmul(xq, x_scale, self.qweight, self.scale, x.dtype)  # [T, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"use_scaled_mm={self.use_scaled_mm}")
