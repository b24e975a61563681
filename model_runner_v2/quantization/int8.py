"""Weight-only int8: per-output-channel symmetric scales, dequantised in the matmul epilogue."""

from __future__ import annotations

import torch
from torch import nn

INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never produced, so q and -q are both representable
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (and q = 0) instead of dividing by zero


@torch.no_grad()
def quantize_int8_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] fp32) with w ≈ q * scale[:, None].

    scale = max|w_row| / 127 and q = round(w / scale) clamped to [-127, 127], computed in fp32, so the error of
    every element is at most scale / 2 of its row."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / INT8_MAX).clamp(min=_MIN_SCALE)  # [N]
    q = torch.round(w32 / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] float, q [N, K] int8, scale [N] fp32 -> [T, N] in x.dtype.

    The scale is applied to the output, (x @ q^T) * scale, not to the weight: q is exact in every float dtype
    (|q| <= 127 fits bf16's 8-bit mantissa), one [T, N] multiply replaces an [N, K] one, and this is the
    epilogue a fused int8 GEMM would run. fp16 accumulates in fp32 because x @ q^T is ~1/scale (often ~1e3)
    times the real output and would overflow fp16's 65504; bf16 and fp32 have the range."""
    acc = torch.float32 if x.dtype == torch.float16 else x.dtype
    y = torch.nn.functional.linear(x.to(acc), q.to(acc)) * scale.to(acc)
    return y.to(x.dtype)


class Int8Linear(nn.Module):
    """Drop-in for layers.Linear: y = (x @ q^T) * scale (+ b). qweight [N, K] int8, scale [N] fp32, bias in the
    model dtype (unquantized)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] fp32
        self.bias = bias  # [N] model dtype, or None

    @classmethod
    def from_linear(cls, linear: nn.Module) -> Int8Linear:
        q, scale = quantize_int8_per_row(linear.weight)
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x.reshape(-1, self.in_features), self.qweight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
