"""LayerNorm, optionally fused with the residual add before it: one Triton program per token row.

The models with LayerNorms (GPT-2, GPT-BigCode, OPT, GPT-NeoX, GPT-J, Falcon, Phi-2, StableLM, StarCoder2, OLMo;
Nemotron's LayerNorm1P through UNIT_OFFSET) ran torch's `x + residual` and `F.layer_norm` as two kernels a norm; this
is one (StarCoderBase-1B: 49 LayerNorms and 49 adds a decode step, 0.36 ms of 2.6 on the H100, session 37). The
plain-torch reference, and the engine's CPU path, is `layer_norm_torch`; `tests/kernels/test_layer_norm.py` compares
the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import env_flag
from .norm_rows import load_row, norm_rows
from .rounding import dtype_code, round_to

# REPLAYLLM_LAYER_NORM_KERNEL=0: torch's add and layer_norm on CUDA too (an A/B switch for the benches, read once at
# import; layers.LayerNorm consults it).
ENABLED = env_flag("REPLAYLLM_LAYER_NORM_KERNEL")


@triton.jit
def _layer_norm_kernel(
    out_ptr,  # [T, N] x's dtype, contiguous: the normed rows
    res_out_ptr,  # [T, N] x's dtype, contiguous: x + residual, the new residual (HAS_RESIDUAL only)
    x_ptr,  # [T, N], unit column stride
    res_ptr,  # [T, N] residual (HAS_RESIDUAL only), unit column stride
    w_ptr,  # [N] weight, x's dtype (HAS_WEIGHT only)
    b_ptr,  # [N] bias, x's dtype (HAS_BIAS only)
    stride_x,  # elements between two rows of x
    stride_r,  # elements between two rows of residual
    N,  # hidden size
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,  # False: OLMo's parameter-free norm (no weight and no bias)
    HAS_BIAS: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,  # Nemotron's LayerNorm1P: (weight + 1), rounded to the model dtype, as the weight
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    BLOCK: tl.constexpr,  # next power of two >= N: the whole row lives in one program
):
    # torch's layer_norm on a 16-bit input: fp32 statistics (biased variance), (x - mean) * rstd * w + b in fp32,
    # one rounding at the end. Its mean and variance come from a Welford pass, these from two plain sums: the fp32
    # statistics may differ in their last bits, so an output may sit one 16-bit ulp away where the fp32 value lies
    # next to a rounding boundary (the test's bound).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = load_row(x_ptr, res_ptr, res_out_ptr, row, stride_x, stride_r, N, offs, ok, HAS_RESIDUAL, DTYPE)
    mean = tl.sum(x, 0) / N  # masked tail loads 0: adds nothing
    centred = tl.where(ok, x - mean, 0.0)
    var = tl.sum(centred * centred, 0) / N
    y = centred * tl.rsqrt(var + eps)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            w = round_to(w + 1.0, DTYPE)  # HF's `self.weight + 1.0` in the weight's dtype
        y = y * w
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, round_to(y, DTYPE).to(out_ptr.dtype.element_ty), mask=ok)


def _check_param(p: torch.Tensor | None, x: torch.Tensor, name: str) -> None:
    hidden = x.shape[-1]
    if p is not None and (p.dtype != x.dtype or tuple(p.shape) != (hidden,) or not p.is_contiguous()
                          or p.device != x.device):
        raise ValueError(f"{name} must be a contiguous {x.dtype} [{hidden}] on {x.device}, got {p.dtype} "
                         f"{tuple(p.shape)} on {p.device}")


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton LayerNorm over the last dim. x [..., N] (unit last-dim stride); weight, bias [N] in x's dtype or None
    (a bias needs a weight); unit_offset: the norm scales by (weight + 1) (Nemotron's LayerNorm1P). Without
    residual returns normed [..., N]; with residual [..., N] returns (normed, x + residual), both fresh contiguous
    buffers (sizes from shapes only: CUDA-graph safe). Numerics: `layer_norm_torch`'s up to the statistics' last
    fp32 bits."""
    code = dtype_code(x.dtype, "x")
    x2, r2, out, res_out = norm_rows(x, residual)
    if weight is None and (bias is not None or unit_offset):
        raise ValueError("a LayerNorm bias or unit offset needs a weight")
    _check_param(weight, x, "weight")
    _check_param(bias, x, "bias")
    hidden = x.shape[-1]
    rows = x2.shape[0]
    if rows and hidden:
        block = triton.next_power_of_2(hidden)
        _layer_norm_kernel[(rows,)](
            out, out if res_out is None else res_out, x2, r2, x2 if weight is None else weight,
            x2 if bias is None else bias, x2.stride(0), r2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            UNIT_OFFSET=unit_offset, DTYPE=code, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out if residual is None else (out, res_out)


def layer_norm_torch(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, unit_offset: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (the engine's CPU path): F.layer_norm in x's dtype (fp32 inside, one rounding), HF's
    nn.LayerNorm op for op; without a weight, OLMo's parameter-free norm (the same thing on the fp32 row, cast
    back); unit_offset: Nemotron's LayerNorm1P, `weight + 1` in the weight's dtype as the scale. With residual: the
    add in the model dtype first (HF's `residual + h`); returns (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        return layer_norm_torch(x, weight, bias, eps, unit_offset=unit_offset), x
    if weight is None:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(x.dtype)
    return F.layer_norm(x, weight.shape, weight + 1.0 if unit_offset else weight, bias, eps)
