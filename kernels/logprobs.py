"""Raw logprobs in one read of the logits: the chosen token's logprob and rank, and the row's top-k."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import triton_can_run, use_fused_kernels

BLOCK_V = 4096  # vocab entries per program of the chunk kernel (a power of two)
NUM_WARPS = 8
TOPK_KERNEL_MAX = 64  # larger k: the kernel still gives logprob and rank, torch.topk gives the top-k
_INT64_MIN = tl.constexpr(-(2**63))  # an empty candidate: below every packed (logit, index) key


@triton.jit
def _pack_keys(x, idx):
    """fp32 logits x and int vocab ids idx (same shape) -> int64 keys ordered like (x, -idx): a float's bits
    with every bit but the sign flipped for negatives compare like the floats, as signed int32; the low half
    is 2**31 - 1 - id, so among equal logits the lowest id is the largest key."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) | (2147483647 - idx).to(tl.int64)


# k is a runtime int that Triton must not specialise (k == 1, k % 16 == 0 would each compile another variant):
# the combine kernel's CAND_PAD alone sets which k share a compiled kernel (warm_up_ks).
@triton.jit(do_not_specialize=["k"])
def _logprobs_chunk_kernel(
    logits_ptr,  # [R, V] fp32/bf16/fp16, last dim contiguous
    stride_row,  # elements between two rows of logits
    token_ptr,  # [R] int64, the chosen token of each row
    max_ptr,  # [R, C] fp32 out: the chunk's max logit (-inf if the chunk is all -inf)
    sum_ptr,  # [R, C] fp32 out: sum of exp(logit - chunk max); 0 for an all -inf chunk
    count_ptr,  # [R, C] int32 out: entries of the chunk whose logit is >= the token's (the token itself too)
    cand_ptr,  # [R, C, k] int64 out: the chunk's k largest packed keys, descending (unused if k == 0)
    V,  # vocab size
    k,  # top-k candidates per chunk (runtime: no recompile per k)
    BLOCK: tl.constexpr,  # vocab entries per chunk
):
    # Grid (R, C): one program per (row, vocab chunk); every logit is loaded exactly once.
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = idx < V
    row_ptr = logits_ptr + row * stride_row
    x = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)  # upcast before any math
    tok_x = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf: exp(-inf - 0) = 0, not NaN
    s = tl.sum(tl.exp(x - m_safe), 0)
    n = tl.sum(((x >= tok_x) & ok).to(tl.int32), 0)  # ok: a -inf token counts no padding
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, s)
    tl.store(count_ptr + out, n)
    keys = tl.where(ok, _pack_keys(x, idx), _INT64_MIN)  # [BLOCK]
    for i in range(k):  # k rounds of max + mask; a tail chunk shorter than k emits _INT64_MIN
        best = tl.max(keys, 0)
        tl.store(cand_ptr + out * k + i, best)
        keys = tl.where(keys == best, _INT64_MIN, keys)


@triton.jit(do_not_specialize=["k"])
def _logprobs_combine_kernel(
    logits_ptr,  # [R, V] as above
    stride_row,
    token_ptr,  # [R] int64
    max_ptr,  # [R, C] fp32
    sum_ptr,  # [R, C] fp32
    count_ptr,  # [R, C] int32
    cand_ptr,  # [R, C * k] int64
    lse_ptr,  # [R] fp32 out: logsumexp of the row
    token_lp_ptr,  # [R] fp32 out: logprob of the token
    rank_ptr,  # [R] int64 out: entries with a logit >= the token's (vLLM's rank: ties count against it)
    topk_ids_ptr,  # [R, k] int64 out
    topk_lp_ptr,  # [R, k] fp32 out
    C,  # chunks per row
    k,
    C_PAD: tl.constexpr,  # next power of two >= C
    CAND_PAD: tl.constexpr,  # next power of two >= C * k (1 when k == 0)
):
    # Grid (R,): merge one row's chunk partials.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, C_PAD)
    c_ok = offs < C
    m = tl.load(max_ptr + row * C + offs, mask=c_ok, other=float("-inf"))
    s = tl.load(sum_ptr + row * C + offs, mask=c_ok, other=0.0)
    n = tl.load(count_ptr + row * C + offs, mask=c_ok, other=0)
    big = tl.max(m, 0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # chunk c's sum is relative to m_safe[c]; an all -inf chunk has s = 0 and weighs nothing
    lse = big_safe + tl.log(tl.sum(s * tl.exp(m_safe - big_safe), 0))
    row_ptr = logits_ptr + row * stride_row
    tok_x = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(token_lp_ptr + row, tok_x - lse)
    tl.store(rank_ptr + row, tl.sum(n.to(tl.int64), 0))
    c_offs = tl.arange(0, CAND_PAD)
    keys = tl.load(cand_ptr + row * C * k + c_offs, mask=c_offs < C * k, other=_INT64_MIN)
    for i in range(k):
        best = tl.max(keys, 0)
        keys = tl.where(keys == best, _INT64_MIN, keys)
        tid = (2147483647 - best.to(tl.int32)).to(tl.int64)  # the id, from the key's low half (truncation)
        tl.store(topk_ids_ptr + row * k + i, tid)
        tl.store(topk_lp_ptr + row * k + i, tl.load(row_ptr + tid).to(tl.float32) - lse)


# (token_logprob, rank, topk_ids, topk_logprobs), and the row's logsumexp last when with_lse=True
Result = tuple


def _check_inputs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> None:
    """Validate types, dtypes, shapes, devices and k; raises ValueError naming the offending argument."""
    for name, t in (("logits", logits), ("token_ids", token_ids)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be 2-D [R, V] with V > 0, got shape {tuple(logits.shape)}")
    if token_ids.dtype != torch.int64 or token_ids.shape != logits.shape[:1]:
        raise ValueError(f"token_ids must be int64 [{logits.shape[0]}], got {token_ids.dtype} "
                         f"{tuple(token_ids.shape)}")
    if token_ids.device != logits.device:
        raise ValueError(f"token_ids is on {token_ids.device} but logits is on {logits.device}")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must be an int in [0, V={logits.shape[1]}], got {k!r}")


def raw_logprobs_triton(logits: torch.Tensor, token_ids: torch.Tensor, k: int, *, with_lse: bool = False,
                        block_v: int = BLOCK_V) -> Result:
    """Triton launcher. logits [R, V] fp32/bf16/fp16 (upcast to fp32 in the kernel; last dim contiguous, any
    row stride); token_ids [R] int64 (each < V: not checked, that would need a host sync); k a Python int in
    [0, V]. Returns (token_logprob [R] fp32, rank [R] int64, topk_ids [R, k] int64, topk_logprobs [R, k] fp32),
    top-k sorted descending (lowest id first among equal logits), None for both when k == 0; with_lse=True
    appends lse [R] fp32 (every logprob returned is fp32 `logit - lse`). Two launches, no host sync, shapes
    fixed by (R, V, k): CUDA-graph safe. `block_v` (a power of two) is the chunk size."""
    _check_inputs(logits, token_ids, k)
    if logits.stride(1) != 1 or not token_ids.is_contiguous():
        raise ValueError("logits must have a contiguous last dim and token_ids must be contiguous")
    if block_v <= 0 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if not use_triton_logprobs_kernel(logits.device):
        raise ValueError(
            f"the Triton logprobs kernel cannot run on {logits.device}: it needs CUDA, or TRITON_INTERPRET=1 "
            "set before replayllm.kernels.logprobs is imported; use raw_logprobs() to fall back to torch"
        )
    R, V = logits.shape
    kk = k if k <= TOPK_KERNEL_MAX else 0  # large k: top-k from torch below
    block = min(block_v, triton.next_power_of_2(V))
    C = triton.cdiv(V, block)
    dev = logits.device
    chunk_max = torch.empty(R, C, dtype=torch.float32, device=dev)
    chunk_sum = torch.empty(R, C, dtype=torch.float32, device=dev)
    chunk_count = torch.empty(R, C, dtype=torch.int32, device=dev)
    cand = torch.empty(R, C, max(kk, 1), dtype=torch.int64, device=dev)
    lse = torch.empty(R, dtype=torch.float32, device=dev)
    token_lp = torch.empty(R, dtype=torch.float32, device=dev)
    rank = torch.empty(R, dtype=torch.int64, device=dev)
    topk_ids = torch.empty(R, max(kk, 1), dtype=torch.int64, device=dev)
    topk_lp = torch.empty(R, max(kk, 1), dtype=torch.float32, device=dev)
    if R > 0:
        _logprobs_chunk_kernel[(R, C)](logits, logits.stride(0), token_ids, chunk_max, chunk_sum, chunk_count,
                                       cand, V, kk, BLOCK=block, num_warps=NUM_WARPS)
        _logprobs_combine_kernel[(R,)](logits, logits.stride(0), token_ids, chunk_max, chunk_sum, chunk_count,
                                       cand, lse, token_lp, rank, topk_ids, topk_lp, C, kk,
                                       C_PAD=triton.next_power_of_2(C), CAND_PAD=triton.next_power_of_2(max(C * kk, 1)))
    if k == 0:
        topk_ids = topk_lp = None
    elif kk == 0:
        top_x, topk_ids = logits.topk(k, dim=-1)  # values are exact in the input dtype
        topk_lp = top_x.float() - lse[:, None]
    return (token_lp, rank, topk_ids, topk_lp) + ((lse,) if with_lse else ())


def warm_up_ks(vocab_size: int, max_k: int, block_v: int = BLOCK_V) -> list[int]:
    """One k in [0, max_k] per compiled variant of the two kernels (the smallest of each): they compile once per
    CAND_PAD = next_power_of_2(C * k) (k > TOPK_KERNEL_MAX runs as k = 0). The engine's start-up warm-up
    (engine/warm_up.py) runs each, so that no request compiles them later."""
    chunks = triton.cdiv(vocab_size, min(block_v, triton.next_power_of_2(vocab_size)))
    seen: dict[int, int] = {}
    for k in range(min(max_k, TOPK_KERNEL_MAX, vocab_size) + 1):
        seen.setdefault(triton.next_power_of_2(max(chunks * k, 1)), k)
    return sorted(seen.values())


def raw_logprobs_torch(logits: torch.Tensor, token_ids: torch.Tensor, k: int, *, with_lse: bool = False) -> Result:
    """Plain-torch reference of `raw_logprobs_triton` (same contract and formula, `logit - lse` in fp32)."""
    _check_inputs(logits, token_ids, k)
    x = logits.float()  # [R, V]
    lse = row_logsumexp(x)  # [R]
    token_x = x.gather(1, token_ids[:, None])  # [R, 1]
    rank = (x >= token_x).sum(dim=-1)  # vLLM's; compares logits: exact, unlike comparing rounded logprobs
    topk_ids = topk_lp = None
    if k > 0:
        top_x, topk_ids = x.topk(k, dim=-1)
        topk_lp = top_x - lse[:, None]
    return (token_x[:, 0] - lse, rank, topk_ids, topk_lp) + ((lse,) if with_lse else ())


LSE_CHUNK = 1024  # row_logsumexp's partial sums: elements each


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of x [R, V] fp32 -> [R], each row's bits its own whatever R and the thread count.
    torch's CPU `logsumexp` of one row (one output) splits the row between its threads, of many rows gives each row
    to one thread: with more than one thread a row's last bit moved with the batch (1.9e-6 in batch-invariant mode).
    Here the row max (exact in any order, torch's +-inf rule: 0 then), then fixed chunks of LSE_CHUNK exp()s summed
    (many outputs: never split) and their sums (a short row per output: never split), then log + max."""
    rows, width = x.shape
    top = x.amax(dim=-1, keepdim=True)  # [R, 1]
    top = top.masked_fill(top.abs() == float("inf"), 0.0)
    e = (x - top).exp()
    pad = (-width) % LSE_CHUNK
    if pad:  # zeros after the row's last chunk: x + 0 is x, the chunk's order unchanged
        e = torch.nn.functional.pad(e, (0, pad))
    return e.view(rows, (width + pad) // LSE_CHUNK, LSE_CHUNK).sum(dim=-1).sum(dim=-1).log() + top[:, 0]


def use_triton_logprobs_kernel(device: torch.device) -> bool:
    """True on CUDA; on CPU only when the Triton interpreter is on (`TRITON_INTERPRET=1`)."""
    return triton_can_run(device)


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int, *, with_lse: bool = False) -> Result:
    """(token_logprob, rank, topk_ids, topk_logprobs[, lse]): the Triton kernel on CUDA, the torch reference on
    CPU unless the fused kernels are asked for under the interpreter (kernels/dispatch.py: the interpreter costs
    ~0.6 ms a program, far too slow for every sampled step of the CPU test suite)."""
    if use_fused_kernels(logits.device) and use_triton_logprobs_kernel(logits.device):
        return raw_logprobs_triton(logits, token_ids, k, with_lse=with_lse)
    return raw_logprobs_torch(logits, token_ids, k, with_lse=with_lse)
