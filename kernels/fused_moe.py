"""Fused MoE experts: the routed SwiGLU experts of a sparse layer as two grouped-GEMM Triton kernels, with no host
sync and static shapes, so the whole computation can be captured in a CUDA graph (issue 30).

`fused_experts_triton(x, w13, w2, topk_ids, topk_weights)` computes exactly what `StackedExperts.forward`
(model_runner_v2/models/moe.py) does: for each token t and choice j, with e = topk_ids[t, j],

    y[t, j] = (SiLU(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)) @ w2[e].T        (in the model dtype)
    out[t]  = sum_j (y[t, j] * topk_weights[t, j].to(dtype))                        (j = 0..k-1, torch ops)

Steps (shapes: T tokens, E experts, top k, hidden H, expert width I, block BLOCK_M):
1. `moe_align` (kernels/moe_align.py): copies c = t*k + j sorted by expert on the device, each expert's group padded
   to a multiple of BLOCK_M, in a buffer of the static bound cdiv(T*k + E*(BLOCK_M-1), BLOCK_M) blocks, with the
   expert of each block and the real padded row count (a [1] device tensor).
2. `_moe_gemm1_kernel`, grid (max_blocks * cdiv(I, BLOCK_N),): a block of BLOCK_M rows of one expert gathers its
   tokens' rows of x and computes the gate and up tiles (two fp32 accumulators over H in BLOCK_K steps), then the
   SiLU·mul epilogue, storing `h` [max_blocks * BLOCK_M, I] in the model dtype. A block at or past the real row
   count (read from device memory) returns at once.
3. `_moe_gemm2_kernel`, grid (max_blocks * cdiv(H, BLOCK_N),): h @ w2[e].T over I, each valid row stored straight
   into row c of y [T*k, H] (every copy lands in exactly one padded row, so y is fully written; no gather).
4. torch: `(y.view(T, k, H) * topk_weights.to(dtype)[..., None]).sum(dim=1)`, moe.py's own last line.

Numerics: fp32 accumulation. The values torch rounds to the model dtype are rounded at the same places with
`rounding.round_to` (F.linear's outputs gate and up, F.silu, the product, the down projection's output), so in
bf16/fp16 the kernels differ from the torch loop only where the fp32 dot products, summed in another order, fall on
different sides of a rounding boundary. fp32 inputs use IEEE fp32 dots (no TF32). bf16/fp16 on CUDA use native
tensor-core dots; under the Triton interpreter (CPU) every tile is cast to fp32 first (its bf16 math is broken).

Batch invariance: YES for a fixed tile configuration (the default depends on the dtype and the device only, never
on T). Every output element of both GEMMs is one fp32 sum over K in BLOCK_K steps from 0 upwards inside one
program, whichever other rows share its block; the padding rows load zeros; the final sum over j is per token.
So a token's result is bitwise the same alone or in any batch (tests/kernels/test_fused_moe_kernel.py checks it under
the interpreter; on CUDA it holds as long as the compiled dot computes each row independently of the others, as the
tensor-core MMAs do). Passing another `tile` (e.g. a BLOCK_M picked from T) gives up that guarantee.

Ungated ReLU² experts (`relu2=True`: NemotronH's): w13 [E, I, H] holds each expert's up rows alone, GEMM1 one
accumulator and the epilogue relu(up)² (F.relu exact, the square rounded once, as torch.square(F.relu(up))).

Used by model_runner_v2/models/moe.py (StackedExperts.forward) on CUDA; on CPU the model keeps its torch loop.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .activation import (
    ClampedSiLU,
    ClampedSwiGLU,
    ClippedSwiGLU,
    clamp_gate_up,
    clamped_swiglu_torch,
    clipped_swiglu_torch,
    gelu_tanh_and_mul_torch,
    silu_and_mul_torch,
)
from .moe_align import MoeAlignment, moe_align
from .rounding import dtype_code, round_to


class MoeTile(NamedTuple):
    block_m: int  # rows (token copies) per block; every block belongs to one expert
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


TILE_16BIT = MoeTile(64, 64, 64, 4, 3)  # bf16 / fp16 on CUDA: tensor-core dots, fp32 accumulators
TILE_FP32 = MoeTile(32, 32, 32, 4, 2)  # fp32 on CUDA: IEEE dots, small tiles (two accumulators in GEMM1)
TILE_INTERPRET = MoeTile(16, 16, 16, 1, 1)  # the Triton interpreter (CPU): small tiles, cheap programs
GROUP_M = 8  # programs walk GROUP_M row blocks per column tile (L2 reuse); changes no sum


def default_tile(dtype: torch.dtype, device: torch.device) -> MoeTile:
    """The tile for a dtype on a device; never depends on T (see batch invariance in the module docstring)."""
    if torch.device(device).type != "cuda":
        return TILE_INTERPRET
    return TILE_FP32 if dtype == torch.float32 else TILE_16BIT


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (row block, column tile), GROUP_M row blocks per column sweep (as batch_invariant_matmul)."""
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % group_rows
    pid_n = (pid % group) // group_rows
    return pid_m, pid_n


# The token count is not specialised on (one binary for every T: a new batch size compiles nothing).
@triton.jit(do_not_specialize=["num_copies", "num_pid_m"])
def _moe_gemm1_kernel(
    h_ptr,  # [num_pid_m * BLOCK_M, I] contiguous, x's dtype: SiLU(gate) * up per padded row
    x_ptr,  # [T, H], unit column stride
    w13_ptr,  # [E, 2I, H], unit column stride: expert e's gate rows [0, I), up rows [I, 2I) (RELU2: [E, I, H], up)
    b13_ptr,  # HAS_BIAS: [E, 2I] contiguous, the gate | up biases (GPT-OSS)
    sorted_ids_ptr,  # [num_pid_m * BLOCK_M] int32: copy id per padded row, num_copies = padding
    block_expert_ptr,  # [num_pid_m] int32
    num_rows_ptr,  # [1] int32: padded rows in use
    num_copies,  # T * k
    num_pid_m,  # static number of row blocks
    H, I,
    stride_xt, stride_we, stride_wn,
    alpha, limit,  # CLAMPED: GPT-OSS's activation (activation.ClampedSwiGLU); CLAMP_SILU: limit alone
    TOPK: tl.constexpr,
    DTYPE: tl.constexpr,  # rounding.DTYPE_CODES code of x's dtype
    HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr,  # (clamp(up) + 1) * g * sigmoid(alpha g), g = min(gate, limit); False: SiLU(gate) * up
    RELU2: tl.constexpr,  # ungated: relu(up)^2 of the one projection
    CLAMP_SILU: tl.constexpr,  # SiLU(min(gate, limit)) * clamp(up, -limit, limit) (activation.ClampedSiLU)
    CLIP_SILU: tl.constexpr,  # min(SiLU(gate), limit) * clamp(up, -limit, limit) (activation.ClippedSwiGLU)
    GELU_TANH: tl.constexpr,  # GeGLU: gelu_tanh(gate) * up (activation.gelu_tanh's invariant formula)
    UPCAST: tl.constexpr,  # fp32 IEEE dots (fp32 inputs; the interpreter)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the real padded rows: nothing to do (the grid is the static upper bound)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    copy = tl.load(sorted_ids_ptr + offs_m)
    row_ok = copy < num_copies
    token = tl.where(row_ok, copy // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xt  # [BM, 1]
    w_gate = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    w_up = w_gate if RELU2 else w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):  # the one reduction per element: H in BLOCK_K steps from 0
        k = k0 + offs_k
        k_ok = k < H
        a = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        bu = tl.load(w_up + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            a = a.to(tl.float32)
            acc_u = tl.dot(a, bu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_u = tl.dot(a, bu, acc_u)
        if not RELU2:
            bg = tl.load(w_gate + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:
                acc_g = tl.dot(a, bg.to(tl.float32), acc_g, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
    gate = round_to(acc_g, DTYPE)  # F.linear's output, in the model dtype
    up = round_to(acc_u, DTYPE)
    if HAS_BIAS:  # transformers adds the bias to the rounded product: a second rounding
        bias = b13_ptr + expert * 2 * I + offs_n
        gate = round_to(gate + tl.load(bias, mask=n_ok, other=0.0).to(tl.float32), DTYPE)
        up = round_to(up + tl.load(bias + I, mask=n_ok, other=0.0).to(tl.float32), DTYPE)
    if RELU2:  # no bias (NemotronH's experts have none): relu exact, the square rounded once
        r = tl.maximum(up, 0.0)
        h = round_to(r * r, DTYPE)
    elif GELU_TANH:  # 0.5 g (1 + tanh(y)) = g sigmoid(2y), y = sqrt(2 / pi) (g + 0.044715 g^3): one rounding
        z = 2.0 * (0.7978845608028654 * (gate + 0.044715 * gate * gate * gate))
        h = round_to(round_to(gate / (1.0 + tl.exp(-z)), DTYPE) * up, DTYPE)
    elif CLAMPED:  # every op as transformers' GptOssExperts, each rounded to the model dtype (clamps are exact)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = round_to(1.0 / (1.0 + tl.exp(-round_to(gate * alpha, DTYPE))), DTYPE)
        h = round_to(round_to(up + 1.0, DTYPE) * round_to(gate * sig, DTYPE), DTYPE)
    else:
        if CLAMP_SILU:  # HY-V4's, DeepSeek-V4's: the clamps exact, then SwiGLU as below
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        act = round_to(gate / (1.0 + tl.exp(-gate)), DTYPE)  # F.silu: fp32 math, one rounding
        if CLIP_SILU:  # Ling 3's, Step 3.7's: SiLU's output capped, each clamp rounded as torch's on the tensor
            act = round_to(tl.minimum(act, limit), DTYPE)
            up = round_to(tl.minimum(tl.maximum(up, -limit), limit), DTYPE)
        h = round_to(act * up, DTYPE)
    out = h_ptr + offs_m.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_copies", "num_pid_m"])
def _moe_gemm2_kernel(
    y_ptr,  # [T * k, H] contiguous, x's dtype: row c = copy c's expert output
    h_ptr,  # [num_pid_m * BLOCK_M, I] contiguous (GEMM1's output)
    w2_ptr,  # [E, H, I], unit column stride
    b2_ptr,  # HAS_BIAS: [E, H] contiguous
    sorted_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_copies,
    num_pid_m,
    H, I,
    stride_we, stride_wn,
    DTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    copy = tl.load(sorted_ids_ptr + offs_m)
    row_ok = copy < num_copies
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * I  # [BM, 1]
    w_cols = w2_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < I
        a = tl.load(h_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BK, BN]
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    y = round_to(acc, DTYPE)
    if HAS_BIAS:
        y = round_to(y + tl.load(b2_ptr + expert * H + offs_n, mask=n_ok, other=0.0).to(tl.float32), DTYPE)
    out = y_ptr + tl.where(row_ok, copy, 0).to(tl.int64)[:, None] * H + offs_n[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _check(x, w13, w2, topk_ids, topk_weights, relu2: bool = False) -> None:
    code = dtype_code(x.dtype, "x")  # noqa: F841 (raises on an unsupported dtype)
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H] ([E, I, H] ungated), w2 [E, H, I], got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, rows, hidden = w13.shape
    parts = 1 if relu2 else 2
    if hidden != x.shape[1] or rows % parts or tuple(w2.shape) != (num_experts, hidden, rows // parts):
        raise ValueError(f"inconsistent shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"x, w13 and w2 must share one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be [T, k] int32/int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be float {tuple(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{tuple(topk_weights.shape)}")
    if len({t.device for t in (x, w13, w2, topk_ids, topk_weights)}) != 1:
        raise ValueError("x, w13, w2, topk_ids and topk_weights must be on one device")


def _check_biases(x, w13, w2, b13, b2) -> None:
    """b13 [E, 2I] and b2 [E, H] (either may be None), contiguous, on x's device (any float dtype)."""
    for name, bias, shape in (("b13", b13, w13.shape[:2]), ("b2", b2, w2.shape[:2])):
        if bias is not None and (tuple(bias.shape) != tuple(shape) or not bias.is_contiguous()
                                 or bias.device != x.device or not bias.is_floating_point()):
            raise ValueError(f"{name} must be a contiguous float [{shape[0]}, {shape[1]}] on {x.device}, got "
                             f"{bias.dtype} {tuple(bias.shape)} on {bias.device}")


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, *, tile: MoeTile | None = None, b13: torch.Tensor | None = None,
                         b2: torch.Tensor | None = None, act: ClampedSwiGLU | ClampedSiLU | ClippedSwiGLU | None = None,
                         relu2: bool = False, gelu_tanh: bool = False, fp32_weights: bool = False) -> torch.Tensor:
    """Routed SwiGLU experts, summed over the top k (semantics: `StackedExperts.forward`, moe.py; fp32_weights:
    combine_copies').

    x [T, H] fp32/bf16/fp16 (unit column stride, else copied); w13 [E, 2I, H] (expert e's gate rows then its up
    rows; `gate_up_proj.view(E, 2I, H)`); w2 [E, H, I] (`down_proj.view(E, H, I)`), both x's dtype with unit
    column stride; topk_ids [T, k] int32/int64 in [0, E) (unchecked: checking would sync); topk_weights [T, k]
    float (weighing each copy as combine_copies says); b13 [E, 2I] / b2 [E, H]: biases added to the
    rounded gate | up and down outputs (GPT-OSS; None: none); act: GPT-OSS's clamped SwiGLU instead of SiLU(gate) *
    up, or ClampedSiLU (SiLU · mul of the clamped gate and up: HY-V4's); relu2: ungated ReLU² experts, w13 [E, I, H]
    their up rows (no bias, no act); gelu_tanh: GeGLU experts (gelu_tanh(gate) * up, the GELU as
    activation.gelu_tanh's invariant form). Returns a fresh [T, H] in x's dtype.

    No host sync and every allocation and grid sized from (T, k, E, tile) only: CUDA-graph capturable.
    `tile` defaults to `default_tile(dtype, device)`; a token's result is batch invariant for a fixed tile.
    Runs on CUDA, or on CPU under the Triton interpreter (TRITON_INTERPRET=1)."""
    _check(x, w13, w2, topk_ids, topk_weights, relu2)
    if relu2 and (b13 is not None or b2 is not None or act is not None):
        raise ValueError("relu2 experts take no biases and no other activation")
    _check_biases(x, w13, w2, b13, b2)
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if num_tokens == 0 or top_k == 0 or hidden == 0:
        return x.new_zeros(num_tokens, hidden)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w13.stride(2) != 1:
        w13 = w13.contiguous()
    if w2.stride(2) != 1:
        w2 = w2.contiguous()
    tile = tile or default_tile(x.dtype, x.device)
    align: MoeAlignment = moe_align(topk_ids, num_experts, tile.block_m)
    num_pid_m = align.block_expert.shape[0]
    num_copies = num_tokens * top_k
    code = dtype_code(x.dtype, "x")
    upcast = x.dtype == torch.float32 or x.device.type != "cuda"
    common = dict(DTYPE=code, UPCAST=upcast, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                  GROUP_M=GROUP_M, num_warps=tile.num_warps, num_stages=tile.num_stages)

    h = torch.empty(num_pid_m * tile.block_m, inter, dtype=x.dtype, device=x.device)
    if inter:
        _moe_gemm1_kernel[(num_pid_m * triton.cdiv(inter, tile.block_n),)](
            h, x, w13, x if b13 is None else b13, align.sorted_ids, align.block_expert, align.num_rows, num_copies,
            num_pid_m, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
            getattr(act, "alpha", 0.0), act.limit if act else 0.0,
            TOPK=top_k, HAS_BIAS=b13 is not None, CLAMPED=isinstance(act, ClampedSwiGLU), RELU2=relu2,
            CLAMP_SILU=isinstance(act, ClampedSiLU), CLIP_SILU=isinstance(act, ClippedSwiGLU), GELU_TANH=gelu_tanh,
            **common,
        )
        y = torch.empty(num_copies, hidden, dtype=x.dtype, device=x.device)
        _moe_gemm2_kernel[(num_pid_m * triton.cdiv(hidden, tile.block_n),)](
            y, h, w2, x if b2 is None else b2, align.sorted_ids, align.block_expert, align.num_rows, num_copies,
            num_pid_m, hidden, inter, w2.stride(0), w2.stride(1), HAS_BIAS=b2 is not None, **common,
        )
    else:  # I = 0: every expert outputs zeros (or its down bias)
        y = x.new_zeros(num_copies, hidden)
        if b2 is not None:
            y += b2[topk_ids.reshape(-1)].to(x.dtype)
    return combine_copies(y.view(num_tokens, top_k, hidden), topk_weights, fp32_weights)


def combine_copies(y: torch.Tensor, weights: torch.Tensor, fp32_weights: bool = False) -> torch.Tensor:
    """y [T, k, H] (each copy's expert output, the model dtype), weights [T, k] fp32 -> [T, H]: each token's k rows
    weighted and summed in j order, as transformers' default (grouped_mm) experts combine them: a router that hands
    the model dtype (Mixtral's, Qwen's cast) weighs each copy in it (the product rounded), then sums; a router that
    hands fp32 weights (DeepSeek-V3's, GLM-4-MoE's: `fp32_weights`) weighs and sums in fp32, rounded once."""
    if fp32_weights:
        return (y.float() * weights[..., None]).sum(dim=1).to(y.dtype)
    return (y * weights.to(y.dtype)[..., None]).sum(dim=1)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, *, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        act: ClampedSwiGLU | ClampedSiLU | ClippedSwiGLU | None = None, relu2: bool = False,
                        gelu_tanh: bool = False, fp32_weights: bool = False) -> torch.Tensor:
    """Plain torch, the loop of `StackedExperts.forward` (moe.py) on the stacked weights: copies grouped by expert,
    each expert with any copy runs F.linear (+ its bias, a separate add), SiLU·mul (`silu_and_mul_torch`; or the
    clamped SwiGLU; relu2: torch.square(F.relu(up)); gelu_tanh: F.gelu(gate, "tanh") * up) and F.linear (+ bias)
    on its group, each copy's output in its own row, then weighted and summed over j (combine_copies). Syncs with
    the host (the group sizes): a reference, not for CUDA graphs."""
    _check(x, w13, w2, topk_ids, topk_weights, relu2)
    _check_biases(x, w13, w2, b13, b2)
    num_tokens, k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = x.new_empty(num_tokens * k, hidden)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        copies = order[start : start + n]
        start += n
        gate_up = F.linear(x[copies // k], w13[e])
        if b13 is not None:
            gate_up = gate_up + b13[e].to(x.dtype)
        if relu2:
            h = torch.square(F.relu(gate_up))
        elif gelu_tanh:
            h = gelu_tanh_and_mul_torch(gate_up)
        elif isinstance(act, ClippedSwiGLU):
            h = clipped_swiglu_torch(gate_up, act.limit)
        elif isinstance(act, ClampedSiLU):
            h = silu_and_mul_torch(clamp_gate_up(gate_up, act.limit))
        else:
            h = silu_and_mul_torch(gate_up) if act is None else clamped_swiglu_torch(gate_up, act)
        y = F.linear(h, w2[e])
        out[copies] = y if b2 is None else y + b2[e].to(x.dtype)
    return combine_copies(out.view(num_tokens, k, hidden), topk_weights, fp32_weights)
