"""Batch-invariant linear layer: y = x W^T (+ b) whose every row is reduced in an order that depends on that row only.

A library GEMM picks its algorithm from the shapes (split-K, tile sizes, a GEMV for one row), so the same row of
`x` gives different last bits in a batch of 1 and a batch of 64. Here:

- `_matmul_kernel` (Triton, CUDA): no split-K: output element (m, n) is always the sum over K from k = 0
  upwards, inside one program, whatever M is. With 16-bit inputs on CUDA that sum is a chain of tensor-core
  instructions, each adding the next 16 (hardware) products into the fp32 accumulator, whatever the tile: BLOCK_K
  only sets how many instructions one loop step issues, BLOCK_M / BLOCK_N / warps / stages only which program
  computes the element. So the tile may follow M (`invariant_tile`: a narrow tile for a few rows, a wide one for
  many) and every row keeps its bits (bench/batch_invariant_sweep.py compares every tile's output bit for bit;
  the GPU test tests/engine/test_batch_invariant.py::test_matmul_rows_do_not_depend_on_m checks the rows across
  the M buckets). fp32 (IEEE
  dots: FMA chains per BLOCK_K) and the interpreter (one numpy product per tile dot) keep one tile for every M.
- `batch_invariant_linear_torch` (the CPU path and the kernel's reference): products and a sum over the last,
  contiguous dim (`(x[:, None, :] * w[None]).sum(-1)`): torch's CPU reduction of one output element depends
  only on K, never on how many rows share the call (tests/kernels/test_batch_invariant_kernels.py checks M = 1..300).
  Not used on CUDA: torch's CUDA reductions choose their launch from the whole shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import max_shared_memory, use_fused_kernels

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). fp32 and the interpreter: one tile for every M. bf16 / fp16 on
# CUDA (tensor-core dots, fp32 accumulator; any of these tiles gives the same bits, see above), from
# bench/batch_invariant_sweep.py at the Qwen3-0.6B shapes (H200 session 21, H100 session 30):
TILE_16BIT_NARROW = (64, 32, 128, 4, 4)  # up to SMALL_M_MAX rows (any N), and N <= NARROW_MAX_N (o_proj, down_proj)
#   below LARGE_M_MIN rows: 32-wide columns keep ~130 programs busy at M = 256 where the wide tile launches 16
#   (1.7-1.9x faster there); M = 1 and 64: qkv 13.5 -> 8.3 and 13.2 -> 8.0 us against the wide tile (H100)
TILE_16BIT_WIDE = (128, 128, 64, 8, 3)  # the other cases: 1.2-1.4x faster than 64x64x64 on wide N; from
#   LARGE_M_MIN rows on every N (down_proj at M = 1024 / 2048 / 16384: 31.7 / 64.1 / 542 -> 28.2 / 29.2 / 188 us
#   against the narrow tile; the LM head at M = 128 already 133 against 199 us, hence SMALL_M_MAX 64)
NARROW_MAX_N = 2048
SMALL_M_MAX = 64  # rows of a "few rows" call (decode of small batches, single-stream steps)
LARGE_M_MIN = 1024  # rows of a "many rows" call (prefill chunks)
TILE_FP32 = (32, 32, 32, 4, 2)  # fp32: IEEE fp32 dots (no TF32), smaller tiles keep registers from spilling
TILE_16BIT_SMALL = (64, 64, 64, 4, 3)  # GPUs with less shared memory than the two above pipeline (48 KiB)
TILE_INTERPRET = TILE_16BIT_SMALL  # the Triton interpreter (CPU tests): the tile only sets its speed
GROUP_M = 8  # programs walk GROUP_M row tiles per column tile (L2 reuse of W); does not change any sum
TORCH_CHUNK_ELEMS = 1 << 20  # products materialised at once by the torch path (rows x cols x K)


# M is not specialised on (Triton would compile other code for M == 1 or M % 16 == 0): one binary for every M.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    out_ptr,  # [M, N] contiguous, written (x's dtype; fp32 under the interpreter)
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K], unit column stride (nn.Linear's weight)
    bias_ptr,  # [N] (HAS_BIAS only)
    M, N, K,
    stride_xm, stride_wn,  # row strides of x and w (elements)
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 IEEE dots (fp32 inputs; the interpreter, whose bf16 math is broken)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),): program -> (row tile, column tile), grouped for L2 reuse.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BM, 1]
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The one reduction: K in BLOCK_K steps from 0, each a tile dot; masked tails load 0 and add nothing.
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_rows + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN] = W^T tile
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"expected x [..., K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one float dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be {x.dtype} [{weight.shape[0]}], got {bias.dtype} {tuple(bias.shape)}")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")


def _smem_bytes(tile: tuple[int, int, int, int, int], elem: int) -> int:
    bm, bn, bk, _, stages = tile
    return (bm * bk + bk * bn) * elem * stages  # an x tile and a W tile per pipeline stage


def invariant_tile(num_out: int, dtype: torch.dtype, smem: int | None = None, num_rows: int = 1,
                   ) -> tuple[int, int, int, int, int]:
    """The tile of a call with `num_rows` rows and an [num_out, K] weight of `dtype` on a device with `smem`
    bytes of shared memory per block (None: not CUDA, the interpreter's tile; 0: unknown, the H200's tiles).
    fp32, the interpreter and GPUs too small for the pipelined tiles get one tile for every M; 16-bit on CUDA
    picks by M among tiles that sum every element in the same order (module docstring), so a row's bits never
    depend on how many rows share the call either way."""
    if dtype == torch.float32:
        return TILE_FP32
    if smem is None:
        return TILE_INTERPRET
    if smem and max(_smem_bytes(TILE_16BIT_NARROW, 2), _smem_bytes(TILE_16BIT_WIDE, 2)) > smem:
        return TILE_16BIT_SMALL
    if num_rows <= SMALL_M_MAX:
        return TILE_16BIT_NARROW
    if num_rows >= LARGE_M_MIN:
        return TILE_16BIT_WIDE
    return TILE_16BIT_NARROW if num_out <= NARROW_MAX_N else TILE_16BIT_WIDE


def batch_invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                  tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Triton launcher. x [..., K]; weight [N, K]; bias [N] or None; one float dtype. Returns [..., N] in x's
    dtype. The tile is `invariant_tile(N, dtype, smem, M)`, so each row's bits do not depend on M.
    tile: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) instead (sweeps only: the bits follow the tile)."""
    _check(x, weight, bias)
    lead, (num_out, k) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    cuda = x.device.type == "cuda"
    out = torch.empty((m, num_out), dtype=x.dtype if cuda else torch.float32, device=x.device)
    if m and num_out:
        upcast = x.dtype == torch.float32 or not cuda
        bm, bn, bk, warps, stages = tile or invariant_tile(
            num_out, x.dtype, (max_shared_memory(x.device) or 0) if cuda else None, m)
        grid = (triton.cdiv(m, bm) * triton.cdiv(num_out, bn),)
        _matmul_kernel[grid](
            out, x2, weight, weight if bias is None else bias, m, num_out, k, x2.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, UPCAST=upcast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M,
            num_warps=warps, num_stages=stages,
        )
    # Under the interpreter the kernel stores fp32 (its fp32 -> bf16 store truncates); torch rounds here.
    return out.to(x.dtype).reshape(*lead, num_out)


def batch_invariant_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                 ) -> torch.Tensor:
    """Plain torch, row-invariant on CPU: fp32 products x[m, k] * w[n, k], summed over the contiguous last dim
    (one reduction per output element, whose order depends on K only), chunked so at most TORCH_CHUNK_ELEMS
    products exist at once; then the bias, then one rounding to x's dtype. Same contract as the kernel."""
    _check(x, weight, bias)
    lead, (num_out, k) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
    w = weight.float().contiguous()  # [N, K]
    m = x2.shape[0]
    out = torch.empty((m, num_out), dtype=torch.float32, device=x.device)
    # At most TORCH_CHUNK_ELEMS products at once. The chunking may follow M: each output element is one sum over
    # K whatever the chunk around it (the row-invariance tests run M = 1 and M = 300 through other chunk shapes).
    cols = max(1, min(num_out, TORCH_CHUNK_ELEMS // (min(max(m, 1), 64) * max(1, k))))
    rows = max(1, TORCH_CHUNK_ELEMS // (cols * max(1, k)))
    for r0 in range(0, m, rows):
        xr = x2[r0 : r0 + rows, None, :]  # [r, 1, K]
        for c0 in range(0, num_out, cols):
            out[r0 : r0 + rows, c0 : c0 + cols] = (xr * w[None, c0 : c0 + cols, :]).sum(-1)  # [r, c, K] -> [r, c]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, num_out)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           ) -> torch.Tensor:
    """The Triton kernel on CUDA (always: the torch path is not invariant there) and on CPU when the fused
    kernels are asked for under the interpreter (kernels/dispatch.py); the torch path otherwise."""
    if x.device.type == "cuda" or use_fused_kernels(x.device):
        return batch_invariant_linear_triton(x, weight, bias)
    return batch_invariant_linear_torch(x, weight, bias)
