"""Gated activations over the gate | up halves of the MLP's fused projection, in one Triton kernel: SiluAndMul
(silu(gate) * up, SwiGLU) and GeluTanhAndMul (gelu_tanh(gate) * up, GeGLU: Gemma). And GPT-OSS's experts' clamped
SwiGLU in torch (on CUDA the fused MoE kernel applies it: kernels/fused_moe.py)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .rounding import dtype_code, round_to


@triton.jit
def _act_and_mul_kernel(
    out_ptr,  # [T, I] contiguous, x's dtype
    x_ptr,  # [T, 2I] gate | up, unit column stride
    stride_x,  # elements between two rows of x
    I,  # intermediate size (half of x's width)
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    BLOCK: tl.constexpr,  # columns per program
    GELU_TANH: tl.constexpr = False,  # the tanh GELU instead of SiLU
):
    # Grid (T, cdiv(I, BLOCK)).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 g (1 + tanh(y)) = g * sigmoid(2y), y = sqrt(2 / pi) (g + 0.044715 g^3): no cancellation
        z = 2.0 * (0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))
    else:
        z = gate
    act = round_to(gate / (1.0 + tl.exp(-z)), DTYPE)  # fp32 math, one rounding (F.silu / F.gelu's)
    tl.store(out_ptr + row * I + cols, round_to(act * up, DTYPE).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """Triton: x [T, 2I] (gate | up, unit column stride) -> silu(gate) * up [T, I] (gelu_tanh: the tanh GELU's),
    a fresh contiguous buffer in x's dtype. Numerics: `silu_and_mul_torch`'s (gelu_tanh: within a few ulps of
    `gelu_tanh_and_mul_torch`'s; the invariant form's formula)."""
    code = dtype_code(x.dtype, "x")
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with unit column stride, got {tuple(x.shape)} strides {x.stride()}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _act_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, x, x.stride(0), inter, DTYPE=code, BLOCK=block, GELU_TANH=gelu_tanh, num_warps=4,
        )
    return out


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: [..., 2I] (gate | up) -> F.silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) -> F.gelu(gate, approximate="tanh") * up [..., I]: HF's GeGLU (Gemma's
    `gelu_pytorch_tanh`), op for op: the engine's CPU path (CUDA: silu_and_mul_triton(gelu_tanh=True))."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_invariant_torch(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant form (batch_invariant mode on the CPU) and the kernel's formula: the tanh GELU from separate
    fp32 ops as g * sigmoid(2y), its exp through torch.exp (whose SIMD body and scalar tail agree, unlike the
    fused GELU's), rounded to x's dtype, times up."""
    gate, up = x.chunk(2, dim=-1)
    return gelu_tanh(gate, True) * up


def silu_and_mul_invariant_torch(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant plain torch (the CPU path of batch_invariant mode): F.silu's CPU kernel computes the SIMD
    body and the scalar tail of a tensor with different exp implementations, so an element's bits depend on
    where it lands in the batch. Here: fp32 gate / (1 + exp(-gate)) from separate ops (torch.exp agrees in both
    paths: tests/kernels/test_batch_invariant_kernels.py), rounded to x's dtype, then times up (the kernel's
    numerics)."""
    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    act = (g / (1.0 + torch.exp(-g))).to(x.dtype)
    return act * up


class ClampedSwiGLU(NamedTuple):
    """GPT-OSS's expert activation over gate | up: g = min(gate, limit), u = clamp(up, -limit, limit), then
    (u + 1) * g * sigmoid(alpha * g) (transformers' GptOssExperts; config swiglu_alpha / swiglu_limit)."""

    alpha: float = 1.702
    limit: float = 7.0


def clamped_swiglu_torch(x: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: transformers' GPT-OSS experts op for op, each op rounded to x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * act.alpha))


def clamped_swiglu_invariant_torch(x: torch.Tensor, act: ClampedSwiGLU) -> torch.Tensor:
    """The batch-invariant form (batch_invariant mode on the CPU) and the fused MoE kernel's formula: the sigmoid
    from separate fp32 ops through torch.exp (torch.sigmoid's CPU SIMD body and scalar tail may disagree in the last
    bit, as F.silu's do), rounded once, the other ops as clamped_swiglu_torch."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=act.limit)
    up = up.clamp(min=-act.limit, max=act.limit)
    sig = (1.0 / (1.0 + torch.exp(-(gate * act.alpha).float()))).to(x.dtype)
    return (up + 1) * (gate * sig)


class ClampedSiLU(NamedTuple):
    """DeepSeek-V4's and HY-V4's expert activation over gate | up: SiLU(min(gate, limit)) * clamp(up, -limit, limit)
    (transformers' HYV4Experts, config `swiglu_limit`): plain SwiGLU on clamped inputs (clamp_gate_up)."""

    limit: float


def clamp_gate_up(x: torch.Tensor, limit: float) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., 2I]: gate clamped from above at limit, up into [-limit, limit] (exact ops:
    SiluAndMul then computes ClampedSiLU in any of its paths)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.cat([gate.clamp(max=limit), up.clamp(min=-limit, max=limit)], dim=-1)


class ClippedSwiGLU(NamedTuple):
    """Step 3.7's and Ling 3's (BailingHybrid's) expert activation over gate | up: min(SiLU(gate), limit) *
    clamp(up, -limit, limit): the clamp after the activation (transformers' `limit_after_act`), unlike
    ClampedSiLU's."""

    limit: float


def clipped_swiglu_torch(x: torch.Tensor, limit: float, invariant: bool = False) -> torch.Tensor:
    """[..., 2I] (gate | up) -> [..., I]: transformers' Step3p7 / BailingHybrid experts op for op (SiLU rounded to
    x's dtype, the clamps exact, the product rounded); invariant: the SiLU in its row-invariant form."""
    gate, up = x.chunk(2, dim=-1)
    return silu(gate, invariant).clamp(max=limit) * up.clamp(min=-limit, max=limit)


def sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """torch.sigmoid; invariant (batch_invariant mode): 1 / (1 + exp(-x)) in fp32, rounded once. On the CPU
    torch.sigmoid, F.silu, F.softplus and torch.log1p compute a tensor's SIMD body and its scalar tail differently,
    so an element's bits would depend on where it lands in the step; torch.exp, torch.log and torch.rsqrt do not
    (tests/kernels/test_batch_invariant_kernels.py checks the latter, and these forms)."""
    return (1.0 / (1.0 + torch.exp(-x.float()))).to(x.dtype) if invariant else torch.sigmoid(x)


def silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return (x.float() / (1.0 + torch.exp(-x.float()))).to(x.dtype) if invariant else F.silu(x)


def gelu_tanh(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """F.gelu(x, approximate="tanh"); invariant: x * sigmoid(2y) (= 0.5 x (1 + tanh(y)), y = sqrt(2 / pi)
    (x + 0.044715 x^3)) from separate fp32 ops, rounded once (the fused kernel's formula)."""
    if not invariant:
        return F.gelu(x, approximate="tanh")
    g = x.float()
    z = 2.0 * (0.7978845608028654 * (g + 0.044715 * g * g * g))
    return (g / (1.0 + torch.exp(-z))).to(x.dtype)


def softplus(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """F.softplus (beta 1, threshold 20); invariant: log(1 + exp(x)) below the threshold."""
    return torch.where(x > 20, x, torch.log(1.0 + torch.exp(x))) if invariant else F.softplus(x)
