"""GEMV: y [M, N] = x [M, K] @ w [N, K]^T (+ b) for the few rows of a small decode step (M <= GEMV_MAX_M).

Why: at batch 1 a decoder layer's linears are weight streams (Qwen3-0.6B: 31.5 MB a layer), which cuBLAS runs as
small-M GEMMs at ~1-3 TB/s (o_proj, N=1024 K=2048: a 10.5 us tile of 8 columns per CTA; down_proj a split-K GEMM
plus its reduce kernel). Here no tensor core and no split: program j owns BLOCK_N output columns and reads their
whole weight rows, every K chunk unrolled (K is a constexpr), so each program issues all its loads at once and a
few programs per SM keep the HBM busy. Products are fp32, summed per column in a fixed order (the chunks in K
order, then one tree over BLOCK_K), rounded once to x's dtype: the numerics of an fp32-accumulating GEMM (as
cuBLAS's bf16 GEMM), the order differing.

Prologues (a constexpr) fold the kernel before a linear into its launch, a decode step's launch count down by 3 a
layer: SILU_MUL computes silu(gate) * up from the gate | up rows (down_proj; the SiluAndMul kernel's bits), NORM /
NORM_ADD the RMSNorm of the rows, after the residual add (qkv_proj, gate_up_proj; program 0 writes the new
residual). Every program computes the row's 1 / rms itself: the rows are a few KB, read from L2.

Under programmatic dependent launch (kernels/pdl.py, sm_90+) each program loads its first weight chunk before
waiting for the kernel ahead of it (`gdc_wait`), then reads x: for the layers' K = 1024 weights the whole stream
starts under the tail of the previous kernel.

Grid: cdiv(N, BLOCK_N) programs. M is a runtime argument padded to the constexpr M_PAD (1, 2 or 4: one compile
per (K, M_PAD, prologue, tile), the tile chosen from (N, K) and the prologue, never from M). The engine runs M = 1
only (`gemv_wanted`), compiled in the batch-1 CUDA-graph capture's eager run: replays never compile.

When (`gemv_wanted`): steps of one row, every layer weight (bench/gemv_sweep.py on the H200, isolated launches, us,
cuBLAS vs this kernel: qkv 7.7 / 7.1, o_proj 15.3 / 6.1, gate_up 8.5 / 8.0, down 9.0 / 6.8; the LM head, 76.6 /
76.0, stays cuBLAS's); W4's decode step went from 1.31 to 0.95 ms of GPU kernels and 367 to 255 launches. At 2..4
rows the kernel beats cuBLAS in isolation only for N <= K (o_proj 12.8 / 6.4 at M = 2, 13.0 / 7.2 at M = 4;
qkv and gate_up lose at M = 4), and one end-to-end batch-4 run was slower (TPOT 1.61 vs 1.49 ms, in a noisy call;
the [4, BLOCK_N, BLOCK_K] fp32 products with a prologue may spill registers): the engine keeps cuBLAS there until
measured; the launcher takes up to GEMV_MAX_M rows for sweeps and tests.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import silu_and_mul_invariant_torch
from .dispatch import env_flag, use_fused_kernels
from .pdl import gdc_launch_dependents, gdc_wait, pdl_options
from .rms_norm import rms_norm_torch
from .rounding import dtype_code, round_to

GEMV_MAX_M = 4  # rows the launcher takes (M_PAD <= 4: the [M_PAD, BLOCK_N, BLOCK_K] fp32 products in registers)


class GemvTile(NamedTuple):
    block_n: int  # output columns per program (a power of two)
    block_k: int  # K per unrolled chunk (a power of two)
    num_warps: int


_TILE_ENV = "REPLAYLLM_GEMV_TILE"  # "BLOCK_N,BLOCK_K,num_warps": forces one (bench/gemv_sweep.py)
_NORM_TILE_ENV = "REPLAYLLM_GEMV_NORM_TILE"  # the same for the norm prologue's launches only (sweeps)


# REPLAYLLM_GEMV=0 keeps the library GEMM for small steps too (an A/B switch), read once at import.
ENABLED = env_flag("REPLAYLLM_GEMV")


# The prologue computing x from the kernel's inputs (a constexpr): the rows as given, silu(gate) * up of a SwiGLU
# projection's gate | up rows, or RMSNorm of the rows (after the residual add with NORM_ADD).
PLAIN, SILU_MUL, NORM, NORM_ADD = 0, 1, 2, 3


@triton.jit
def _load_x(x_rows, res_rows, g_ptr, inv, k, K: tl.constexpr, mask, PROLOGUE: tl.constexpr, DTYPE: tl.constexpr):
    """x[:, k] as fp32 after the prologue, rounded as the unfused kernels round: SILU_MUL as kernels/activation.py
    (the same bits as running it first); NORM / NORM_ADD as kernels/rms_norm.py given inv = rsqrt(mean + eps)
    [MP] (the add rounded, x * inv rounded, times the weight rounded)."""
    if PROLOGUE == 1:
        gate = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        act = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE)
        return round_to(act * up, DTYPE)
    x = tl.load(x_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE >= 2:
        if PROLOGUE == 3:
            x = round_to(x + tl.load(res_rows + k[None, :], mask=mask, other=0.0).to(tl.float32), DTYPE)
        g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        x = round_to(g[None, :] * round_to(x * inv[:, None], DTYPE), DTYPE)
    return x


@triton.jit
def _load_w(w_rows, k0: tl.constexpr, offs_k, K: tl.constexpr, n_ok, EVEN_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The weight rows' chunk of columns k0 + offs_k [BN, BK] (masked only where it must be: a partial last chunk,
    or a partial last program with not EVEN_N)."""
    k = k0 + offs_k
    if k0 + BLOCK_K > K:
        return tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    if EVEN_N:
        return tl.load(w_rows + k[None, :])
    return tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)


@triton.jit(do_not_specialize=["M", "N", "eps"])
def _gemv_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype
    x_ptr,  # [M, K] contiguous ([M, 2K] gate | up with SILU_MUL)
    w_ptr,  # [N, K] contiguous (nn.Linear's weight)
    bias_ptr,  # [N] x's dtype (HAS_BIAS)
    res_ptr,  # [M, K] contiguous: the residual added to x before the norm (NORM_ADD)
    res_out_ptr,  # [M, K] contiguous: x + residual, written by program 0 (NORM_ADD)
    g_ptr,  # [K] the norm's weight (NORM, NORM_ADD)
    M, N,
    eps,  # the norm's epsilon (NORM, NORM_ADD)
    K: tl.constexpr,
    K_POW2: tl.constexpr,  # next power of two >= K: the norm's whole-row mean
    M_PAD: tl.constexpr,  # a power of two >= M
    PROLOGUE: tl.constexpr,  # PLAIN, SILU_MUL, NORM or NORM_ADD
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no column mask on the weight loads
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py): x read only after gdc_wait
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K  # [BN, 1]
    # The first chunk's weights, loaded before anything the previous kernel writes is read: under PDL this
    # program may already run while its predecessor finishes (the weights are constant during a forward).
    w_first = _load_w(w_rows, 0, offs_k, K, n_ok, EVEN_N, BLOCK_K)
    if PDL:
        gdc_launch_dependents()  # the next PDL launch may start (its own prefetch) while this one streams
        gdc_wait()  # every write of the previous kernels is visible from here on
    x_rows = x_ptr + offs_m[:, None] * (2 * K if PROLOGUE == 1 else K)  # [MP, 1]
    res_rows = res_ptr + offs_m[:, None] * K
    inv = tl.zeros([M_PAD], dtype=tl.float32)
    if PROLOGUE >= 2:  # the norm's 1 / rms over the whole row (every program: the rows are a few KB, in L2)
        cols = tl.arange(0, K_POW2)
        row_mask = m_ok[:, None] & (cols < K)[None, :]
        h = tl.load(x_rows + cols[None, :], mask=row_mask, other=0.0).to(tl.float32)  # [MP, KP]
        if PROLOGUE == 3:
            h = round_to(h + tl.load(res_rows + cols[None, :], mask=row_mask, other=0.0).to(tl.float32), DTYPE)
            if pid == 0:
                tl.store(res_out_ptr + offs_m[:, None] * K + cols[None, :], h.to(res_out_ptr.dtype.element_ty),
                         mask=row_mask)
        inv = tl.rsqrt(tl.sum(h * h, 1) / K + eps)  # masked columns load 0: add nothing
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every chunk's weight load is issued up front
        k = k0 + offs_k
        if k0 == 0:
            w = w_first
        else:
            w = _load_w(w_rows, k0, offs_k, K, n_ok, EVEN_N, BLOCK_K)  # [BN, BK]
        if k0 + BLOCK_K <= K:
            x = _load_x(x_rows, res_rows, g_ptr, inv, k, K, m_ok[:, None], PROLOGUE, DTYPE)  # [MP, BK]
        else:  # the last, partial chunk
            x = _load_x(x_rows, res_rows, g_ptr, inv, k, K, m_ok[:, None] & (k < K)[None, :], PROLOGUE, DTYPE)
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [MP, BN]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = round_to(y, DTYPE)  # exact in the dtype: even the interpreter's truncating store keeps it
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


# 2 columns a program on 2 warps in 1024-wide K chunks: within ~5% of the best tile of bench/gemv_sweep.py on every
# Qwen3-0.6B shape at M = 1 and M = 4 (the best differed per shape by less than the run-to-run noise).
DEFAULT_TILE = GemvTile(2, 1024, 2)
# The norm prologue reads the whole x (and residual) rows once per program for 1 / rms: wider programs, fewer reads.
NORM_TILE = GemvTile(8, 1024, 4)


def gemv_tile(n: int, k: int, prologue: int = PLAIN) -> GemvTile:
    """The tile for an [N, K] weight and a prologue (never chosen from M): REPLAYLLM_GEMV_TILE's if set (and for
    the norm prologues REPLAYLLM_GEMV_NORM_TILE's), else DEFAULT_TILE, or NORM_TILE for the norm prologues."""
    norm = prologue in (NORM, NORM_ADD)
    for name in (_NORM_TILE_ENV, _TILE_ENV) if norm else (_TILE_ENV,):
        override = os.environ.get(name)
        if override:
            return _parse_tile(name, override)
    return NORM_TILE if norm else DEFAULT_TILE


def _parse_tile(name: str, value: str) -> GemvTile:
    try:
        tile = GemvTile(*(int(v) for v in value.split(",")))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be 'BLOCK_N,BLOCK_K,num_warps', got {value!r}") from None
    if min(tile) < 1 or tile.block_n & (tile.block_n - 1) or tile.block_k & (tile.block_k - 1):
        raise ValueError(f"{name}: BLOCK_N and BLOCK_K must be powers of two, got {value!r}")
    return tile


def gemv_wanted(m: int, n: int, k: int) -> bool:
    """Whether the engine runs the GEMV for M rows of an [N, K] weight: one row of a layer's weight (N <= 8K), the
    case measured end to end (module docstring). Not the LM head (N >> K): cuBLAS streams it at ~4.1 TB/s already,
    and it runs outside the CUDA graphs, where a Triton launch costs the host more. Not 2..GEMV_MAX_M rows yet:
    faster in isolation for N <= K, unmeasured (batch 2) or not faster (batch 4) end to end."""
    return m == 1 and n <= 8 * k


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] * (2 if silu_mul else 1):
        want = "[..., 2K] (gate | up)" if silu_mul else "[..., K]"
        raise ValueError(f"expected x {want} and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    dtype_code(x.dtype, "x")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (the kernel streams its rows; a copy would read it twice)")
    if 0 in weight.shape:
        raise ValueError(f"weight must be non-empty, got {tuple(weight.shape)}")


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., width] as contiguous [M, width] rows (a copy only when not contiguous), M checked."""
    x2 = x.reshape(-1, width)
    if not 1 <= x2.shape[0] <= GEMV_MAX_M:
        raise ValueError(f"gemv takes 1 to {GEMV_MAX_M} rows, got M = {x2.shape[0]} (x {tuple(x.shape)})")
    return x2 if x2.is_contiguous() else x2.contiguous()


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: GemvTile | None,
            prologue: int, res2: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """One `_gemv_kernel` launch over checked [M, *] rows; returns out [M, N]."""
    num_out, k = weight.shape
    m = x2.shape[0]
    tile = tile or gemv_tile(num_out, k, prologue)
    out = torch.empty((m, num_out), dtype=x2.dtype, device=x2.device)
    _gemv_kernel[(triton.cdiv(num_out, tile.block_n),)](
        out, x2, weight, weight if bias is None else bias, x2 if res2 is None else res2,
        out if res_out is None else res_out, weight if norm_weight is None else norm_weight, m, num_out, eps,
        K=k, K_POW2=triton.next_power_of_2(k), M_PAD=triton.next_power_of_2(m), PROLOGUE=prologue,
        HAS_BIAS=bias is not None, DTYPE=dtype_code(x2.dtype, "x"), EVEN_N=num_out % tile.block_n == 0,
        BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, **pdl_options(x2.device),
    )
    return out


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tile: GemvTile | None = None, silu_mul: bool = False) -> torch.Tensor:
    """Triton launcher. x [..., K] with 1 <= M <= GEMV_MAX_M rows (M = the product of the leading dims; copied when
    not contiguous); weight [N, K] contiguous; bias [N] or None; one float dtype. silu_mul: x is [..., 2K], the
    gate | up halves of a SwiGLU projection, and the product is taken with silu(gate) * up (the SiluAndMul kernel
    fused in: one launch less, the same bits). Returns [..., N] in x's dtype, a fresh buffer (CUDA-graph safe).
    Numerics: `gemv_torch`'s, up to the order of the fp32 sum."""
    _check(x, weight, bias, silu_mul)
    out = _launch(_rows(x, x.shape[-1]), weight, bias, tile, SILU_MUL if silu_mul else PLAIN)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, tile: GemvTile | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (after the residual add, when residual is given) and the GEMV in one launch: returns
    (normed(x [+ residual]) @ weight^T (+ bias) [..., N], the new residual [..., K]: x + residual, a fresh buffer,
    or x itself without a residual). The numerics of kernels/rms_norm.py's add_and_norm then `gemv_triton`, up to
    the order of the fp32 sum of squares in the norm's mean (a row's 1/rms may differ in its last bit, so a normed
    element by one rounding step, rarely). norm_weight [K] in x's dtype."""
    _check(x, weight, bias)
    k = weight.shape[1]
    if norm_weight.dtype != x.dtype or tuple(norm_weight.shape) != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be contiguous {x.dtype} [{k}], got {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype} {tuple(x.shape)}), got {residual.dtype} "
                         f"{tuple(residual.shape)}")
    x2 = _rows(x, k)
    res2 = None if residual is None else _rows(residual, k)
    res_out = None if residual is None else torch.empty_like(x2)
    out = _launch(x2, weight, bias, tile, NORM if residual is None else NORM_ADD, res2, res_out, norm_weight, eps)
    new_residual = x if res_out is None else res_out.view(x.shape)
    return out.reshape(*x.shape[:-1], weight.shape[0]), new_residual


def gemv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               silu_mul: bool = False) -> torch.Tensor:
    """Plain-torch reference of the kernel's numerics: the fp32 product (+ fp32 bias), rounded once to x's dtype
    (silu_mul: of silu(gate) * up in x's dtype, as the SiluAndMul kernel rounds it)."""
    _check(x, weight, bias, silu_mul)
    if silu_mul:
        x = silu_and_mul_invariant_torch(x)  # the kernel's formula and roundings
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def norm_gemv_torch(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `norm_gemv_triton`: rms_norm_torch (with the add), then `gemv_torch`."""
    if residual is None:
        normed, new_residual = rms_norm_torch(x, norm_weight, eps), x
    else:
        normed, new_residual = rms_norm_torch(x, norm_weight, eps, residual)
    return gemv_torch(normed, weight, bias), new_residual


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the GEMV kernel: the switch ENABLED, the fused kernels on x's device
    (kernels/dispatch.py: CUDA), bf16/fp16, weight of x's dtype and contiguous, and `gemv_wanted` for x's rows
    (x's width is not checked: K, or 2K for the silu_mul prologue)."""
    if not ENABLED or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if x.dim() < 1 or weight.dim() != 2 or not weight.is_contiguous() or 0 in weight.shape:
        return False
    m = math.prod(x.shape[:-1])
    return m >= 1 and gemv_wanted(m, *weight.shape) and use_fused_kernels(x.device)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias): the GEMV kernel where `gemv_applies`, F.linear (the library GEMM)
    otherwise: larger M, fp32, CPU."""
    if gemv_applies(x, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)
