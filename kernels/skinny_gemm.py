"""Skinny GEMM: y [M, N] = x [M, K] @ w [N, K]^T (+ b) for decode-sized M (1..16), streaming the weight once.

Why: at batch 1 every linear layer is a weight stream (Qwen3-0.6B: 31.5 MB a layer). cuBLAS runs these M = 1 shapes
at ~1.1 TB/s on the H200 (few CTAs, a split-K reduce), against ~4 TB/s of HBM. Here the output columns are cut into
many BLOCK_N-wide programs and, when that gives too few programs for the GPU, K is cut into `splits` ranges too:

- `_skinny_gemm_kernel`, grid (cdiv(N, BLOCK_N), splits): program (j, s) sums x[:, k] * w[n, k] over its columns
  n and K range s in BLOCK_K steps (one [16, BLOCK_K] x [BLOCK_K, BLOCK_N] tile dot a step, fp32 accumulator;
  the M rows are padded to 16, tl.dot's minimum, by masked loads). One split: the bias is added and the result
  rounded to x's dtype and stored. Several: the fp32 partial sum goes to a workspace [splits, M, N].
- `_skinny_reduce_kernel`, grid (M, cdiv(N, REDUCE_BLOCK)): sums the partials in split order 0, 1, ... (fixed:
  no atomics, so eager runs, graph replays and reruns are bitwise equal), adds the bias, rounds once, stores.

Every element is so one fp32 sum over K plus one rounding to the model dtype (as cuBLAS's bf16 GEMM), and its bits
depend on (N, K, tile, splits) only, never on M or on the other rows. M is a runtime argument that Triton does not
specialise on, and the tile and split count depend on (N, K) only: one compile per layer shape serves every M, so
the eager run before each CUDA-graph capture (model_runner_v2/cuda_graph.py, piecewise_graph.py) compiles it.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .device_info import sm_count
from .dispatch import use_fused_kernels
from .rounding import dtype_code, round_to

SKINNY_BLOCK_M = 16  # rows per program: every launch pads M to this (tl.dot's minimum), so M <= 16
REDUCE_BLOCK = 256  # output columns per program of the split-K reduce
PROGRAMS_PER_SM = 4  # split K until cdiv(N, BLOCK_N) * splits reaches this many programs per SM
MAX_SPLITS = 16


class SkinnyTile(NamedTuple):
    block_n: int  # output columns per program (>= 16: tl.dot)
    block_k: int  # K per step: a [BLOCK_N, BLOCK_K] weight tile, BLOCK_K * 2 bytes contiguous per row
    num_warps: int
    num_stages: int  # software-pipelined weight loads in flight per program


# [16, 256] weight tiles (8 KB bf16, 512 contiguous bytes a row) on 4 warps, 3 stages: 16 columns a program give
# every Qwen3-0.6B shape >= 2 programs per SM with the split rule below. bench/skinny_gemm_sweep.py on the H200
# found no one tile best for every shape; [16, 128] on 2 warps, 4 stages was within ~10% of the best on the
# four layer shapes and ~9% faster than this one (docs/benchmarks.md, session 14).
DEFAULT_TILE = SkinnyTile(16, 256, 4, 3)
# (N, K) -> the tile the sweep measured best for that weight shape; shapes not listed take DEFAULT_TILE.
TUNED_TILES: dict[tuple[int, int], SkinnyTile] = {}
_TILE_ENV = "REPLAYLLM_SKINNY_TILE"  # "BLOCK_N,BLOCK_K,num_warps,num_stages[,splits]": forces one (sweeps)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


# The dispatch switches, read once at import (set them in the environment of the process under test):
# REPLAYLLM_SKINNY_GEMM=1 turns the kernel on; REPLAYLLM_SKINNY_MAX_M moves the largest M it takes over from cuBLAS
# (<= 16). Off by default: on the H200 it beats cuBLAS only on o_proj-like shapes (N=1024, K=2048: 8.7 vs 15.4 us
# at M=1) and loses on qkv and gate_up (9.5-10.8 vs 7.9-8.6 us); W4's TPOT moved 1.47 -> 1.44 ms with it
# (docs/benchmarks.md, session 14), not worth another rounding of every bf16 Linear than cuBLAS's.
ENABLED = os.environ.get("REPLAYLLM_SKINNY_GEMM", "0") == "1"
SKINNY_MAX_M = _env_int("REPLAYLLM_SKINNY_MAX_M", 8)
if SKINNY_MAX_M > SKINNY_BLOCK_M:
    raise ValueError(f"REPLAYLLM_SKINNY_MAX_M must be <= {SKINNY_BLOCK_M}, got {SKINNY_MAX_M}")


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype: written when not SPLIT
    part_ptr,  # [splits, M, N] fp32 contiguous: each split's partial sums, written when SPLIT
    x_ptr,  # [M, K] contiguous, 16-byte aligned
    w_ptr,  # [N, K] contiguous (nn.Linear's weight)
    bias_ptr,  # [N] x's dtype (HAS_BIAS and not SPLIT)
    M, N, K,  # M <= BLOCK_M; K is also the row stride of x and w
    k_per_split,  # K columns per split, a multiple of BLOCK_K
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    UPCAST: tl.constexpr,  # fp32 IEEE dots (fp32 inputs; the interpreter, whose bf16 math is broken)
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no column mask on the weight loads
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * K  # [BM, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K  # [1, BN]: weight row n is column n of the W^T tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = split * k_per_split
    k_end = tl.minimum(K, k_begin + k_per_split)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)  # [BM, BK]
            if EVEN_N:
                b = tl.load(w_cols + k[:, None])  # [BK, BN] = W^T tile
            else:
                b = tl.load(w_cols + k[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=ok)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = round_to(acc, DTYPE)  # exact in the dtype: even the interpreter's truncating store keeps it
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["M"])
def _skinny_reduce_kernel(
    out_ptr,  # [M, N] contiguous, x's dtype: written
    part_ptr,  # [SPLITS, M, N] fp32 contiguous
    bias_ptr,  # [N] x's dtype (HAS_BIAS)
    M, N,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):  # split order: the same sum on every run
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, round_to(acc, DTYPE).to(out_ptr.dtype.element_ty), mask=ok)


# -- launch choices -------------------------------------------------------------------------------------------


def skinny_tile(n: int, k: int) -> tuple[SkinnyTile, int | None]:
    """(tile, forced split count or None) for an [N, K] weight: TUNED_TILES' or DEFAULT_TILE, or what
    REPLAYLLM_SKINNY_TILE says. Never chosen from M (one compile per layer shape)."""
    override = os.environ.get(_TILE_ENV)
    if not override:
        return TUNED_TILES.get((n, k), DEFAULT_TILE), None
    try:
        fields = [int(v) for v in override.split(",")]
        if len(fields) not in (4, 5):
            raise ValueError
    except ValueError:
        raise ValueError(f"{_TILE_ENV} must be 'BLOCK_N,BLOCK_K,num_warps,num_stages[,splits]', "
                         f"got {override!r}") from None
    return SkinnyTile(*fields[:4]), (fields[4] if len(fields) == 5 else None)


def skinny_splits(n: int, k: int, tile: SkinnyTile, sms: int | None) -> int:
    """K ranges per output column block: enough for PROGRAMS_PER_SM programs per SM, each range a whole number
    of BLOCK_K steps, none empty, at most MAX_SPLITS; one without an SM count (the interpreter). With the default
    tile on 132 SMs: qkv [4096, 1024] 256 column blocks x 2, o [1024, 2048] 64 x 8, gate_up [6144, 1024] 384 x 2,
    down [1024, 3072] 64 x 6, the LM head [151936, 1024] 9,496 x 1. A pure function of its arguments."""
    if sms is None:
        return 1
    k_steps = triton.cdiv(k, tile.block_k)
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, triton.cdiv(n, tile.block_n))
    return _whole_splits(k_steps, max(1, min(wanted, k_steps, MAX_SPLITS)))


def _whole_splits(k_steps: int, splits: int) -> int:
    """The split count that cutting k_steps BLOCK_K steps into ranges of cdiv(k_steps, splits) steps gives
    (never more than asked: no empty range)."""
    return triton.cdiv(k_steps, triton.cdiv(k_steps, splits))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"expected x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    dtype_code(x.dtype, "x")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"x, weight and bias must share one dtype, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (the kernel streams its rows; a copy would read it twice)")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ValueError(f"weight must be non-empty, got {tuple(weight.shape)}")


# -- launcher, reference, dispatcher --------------------------------------------------------------------------


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       tile: SkinnyTile | None = None, splits: int | None = None) -> torch.Tensor:
    """Triton launcher. x [..., K] with 1 <= M <= 16 rows (M = the product of the leading dims; any strides:
    copied when not contiguous and 16-byte aligned); weight [N, K] contiguous; bias [N] or None; one float dtype.
    tile / splits: None = `skinny_tile` / `skinny_splits` (the sweep passes its own). Returns [..., N] in x's
    dtype, a fresh buffer (shapes only: CUDA-graph safe). Numerics: `skinny_gemm_torch`'s, up to the order of
    the fp32 sum."""
    _check(x, weight, bias)
    num_out, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not 1 <= m <= SKINNY_BLOCK_M:
        raise ValueError(f"skinny_gemm takes 1 to {SKINNY_BLOCK_M} rows, got M = {m} (x {tuple(x.shape)})")
    if not x2.is_contiguous() or x2.data_ptr() % 16:  # one compile per shape: the kernel assumes both
        x2 = x2.clone(memory_format=torch.contiguous_format)
    env_tile, env_splits = skinny_tile(num_out, k)
    tile = tile or env_tile
    splits = splits or env_splits or skinny_splits(num_out, k, tile, sm_count(x.device))
    k_steps = triton.cdiv(k, tile.block_k)
    splits = _whole_splits(k_steps, min(splits, k_steps))  # a forced count too: no empty split
    k_per_split = triton.cdiv(k_steps, splits) * tile.block_k
    code = dtype_code(x.dtype, "x")
    out = torch.empty((m, num_out), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, num_out), dtype=torch.float32, device=x.device) if splits > 1 else out
    bias_arg = weight if bias is None else bias  # not read without a bias
    _skinny_gemm_kernel[(triton.cdiv(num_out, tile.block_n), splits)](
        out, part, x2, weight, bias_arg, m, num_out, k, k_per_split,
        SPLIT=splits > 1, HAS_BIAS=bias is not None, DTYPE=code,
        UPCAST=x.dtype == torch.float32 or x.device.type != "cuda",
        EVEN_N=num_out % tile.block_n == 0, EVEN_K=k % tile.block_k == 0,
        BLOCK_M=SKINNY_BLOCK_M, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    if splits > 1:
        _skinny_reduce_kernel[(m, triton.cdiv(num_out, REDUCE_BLOCK))](
            out, part, bias_arg, m, num_out,
            SPLITS=splits, HAS_BIAS=bias is not None, DTYPE=code, BLOCK=REDUCE_BLOCK, num_warps=2,
        )
    return out.reshape(*lead, num_out)


def skinny_gemm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference of the kernel's numerics: the fp32 product (+ fp32 bias), rounded once to x's dtype."""
    _check(x, weight, bias)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_gemm` takes the Triton kernel: the switch ENABLED, the fused kernels on x's device
    (kernels/dispatch.py: CUDA), bf16/fp16, weight of x's dtype and contiguous, 1 <= M <= SKINNY_MAX_M rows."""
    if not ENABLED or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    if x.dim() < 1 or weight.dim() != 2 or not weight.is_contiguous() or 0 in weight.shape:
        return False
    rows = math.prod(x.shape[:-1])
    return 1 <= rows <= SKINNY_MAX_M and use_fused_kernels(x.device)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias): the Triton kernel where `skinny_gemm_applies`, F.linear (the
    library GEMM) otherwise: larger M, fp32, CPU."""
    if skinny_gemm_applies(x, weight):
        return skinny_gemm_triton(x, weight, bias)
    return F.linear(x, weight, bias)
