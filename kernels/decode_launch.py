"""How the paged decode-attention kernel is launched: its context split count and its tile (GPU-measured choices)."""

from __future__ import annotations

import os

import torch
import triton

from .dispatch import env_flag, env_ints

DECODE_MIN_SPLIT_LEN = 256  # never split a context into chunks shorter than this many keys (many (seq, head) pairs)
# With fewer (sequence, kv head) pairs than SMs (W4's one sequence has 8), 256-key chunks leave a 128-700 key context
# to ~1-3 programs per kv head, each walking 4 key tiles in a row (10.7 us a layer on the H200 at batch 1): shorter
# chunks spread it over more programs. 64 = the wide tile's BLOCK_N, one key tile per program; the launcher rounds
# it up to the tile's BLOCK_N. REPLAYLLM_DECODE_SMALL_SPLIT overrides it (sweeps; 256 gives the large-batch rule).
DECODE_SMALL_BATCH_MIN_SPLIT_LEN = 64
_SMALL_SPLIT_ENV = "REPLAYLLM_DECODE_SMALL_SPLIT"
DECODE_MAX_SPLITS = 32


_MIN_SPLIT_ENV = "REPLAYLLM_DECODE_MIN_SPLIT"  # overrides DECODE_MIN_SPLIT_LEN (sweeps, A/B runs)


def decode_min_split_len(num_seqs: int, num_kv_heads: int, sm_count: int | None) -> int:
    """Fewest keys in a non-empty context chunk: DECODE_MIN_SPLIT_LEN, or the small-batch minimum when the
    (sequence, kv head) pairs are fewer than the SMs. `sm_count`: kernels/device_info.py (None off CUDA: the
    large-batch rule)."""
    if sm_count is None or num_seqs * num_kv_heads >= sm_count:
        return _env_len(_MIN_SPLIT_ENV, DECODE_MIN_SPLIT_LEN)
    return _env_len(_SMALL_SPLIT_ENV, DECODE_SMALL_BATCH_MIN_SPLIT_LEN)


def _env_len(name: str, default: int) -> int:
    override = os.environ.get(name)
    if not override:
        return default
    if not override.isdigit() or int(override) < 1:
        raise ValueError(f"{name} must be a positive integer, got {override!r}")
    return int(override)


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int | None) -> int:
    """How many context chunks each (sequence, kv head) is split into: enough programs to fill the GPU
    (two per SM), never chunks shorter than `decode_min_split_len` keys, at most DECODE_MAX_SPLITS. Off CUDA
    (`sm_count` None): as many as the minimum chunk allows. A pure function of its arguments (host ints only)."""
    max_splits = min(DECODE_MAX_SPLITS,
                     triton.cdiv(max_seq_len, decode_min_split_len(num_seqs, num_kv_heads, sm_count)))
    if sm_count is None:
        return max(1, max_splits)
    wanted = triton.cdiv(2 * sm_count, num_seqs * num_kv_heads)
    return max(1, min(max_splits, wanted))


# Decode tiles, measured on the H200 (bench/decode_attention_sweep.py, Qwen3-0.6B heads, bf16, 256 seqs x 384
# keys): [GROUP_PAD, 32]-key tiles on ONE warp with 4 pipeline stages read 3.8 TB/s, against 3.4 TB/s for
# [.., 64] on 4 warps. A decode program is a pure stream of K/V gathers with a tiny M (the GQA group), so many
# small programs keep more loads in flight than few wide ones. With few programs (small batches, W4's one
# sequence) a one-warp program has too little parallelism: the 4-warp tile stays there.
_DECODE_TILE_WIDE = (64, 4, 3)  # (BLOCK_N, num_warps, num_stages) for 16-bit dtypes when programs are few
_DECODE_TILE_NARROW = (32, 1, 4)  # ... when there are at least _NARROW_MIN_PROGRAMS programs
_NARROW_MIN_PROGRAMS = 1024
_DECODE_TILE_ENV = "REPLAYLLM_DECODE_TILE"  # "BLOCK_N,num_warps,num_stages": overrides the choice (tile sweeps)


# 16-bit heads wider than 128 (GPT-J's and Gemma 2's 256), measured on the H100 (bench/decode_attention_sweep.py
# --heads 16,16,256 and 8,4,256, session 37): [.., 32]-key tiles on 4 warps with 2 stages read 2.95 TB/s at 256 seqs x
# 384 keys, against 2.66 TB/s for the 8-warp, 3-stage tile they shared with fp32 before (10% of GPT-J's decode step).
_DECODE_TILE_WIDE_HEAD = (32, 4, 2)
_NARROW_MAX_GROUP = 16  # the one-warp tile holds at most 16 q heads: Falcon-7B's 71 (padded to 128) ran 2.3x slower


def decode_tile(dtype: torch.dtype, head_dim: int, num_programs: int, group: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel for `num_programs` programs of `group` q heads each.
    fp32 keeps [.., 32] tiles on 8 warps (sm_90: larger fp32 tiles spill registers, see
    paged_prefill_attention_triton); 16-bit heads over 128 wide get _DECODE_TILE_WIDE_HEAD."""
    override = env_ints(_DECODE_TILE_ENV, "BLOCK_N,num_warps,num_stages")
    if override is not None:
        return override
    if dtype == torch.float32:
        return 32, 8, 3
    if head_dim > 128:
        return _DECODE_TILE_WIDE_HEAD
    if num_programs >= _NARROW_MIN_PROGRAMS and group <= _NARROW_MAX_GROUP:
        return _DECODE_TILE_NARROW
    return _DECODE_TILE_WIDE


_REDUCE_ROWS_ENV = "REPLAYLLM_DECODE_REDUCE_ROWS"  # q heads per reduce program: overrides reduce_rows (sweeps)


# A split decode's reduce runs one short program per (sequence, q head) unless there are very many of them: Falcon-7B's
# 71 q heads at 256 sequences made 18,176 programs that each load a few hundred bytes, 26 us a layer (0.84 ms of an
# 8.9 ms step on the H100); 8 heads a program took it to 0.45 ms (step 9.01 -> 8.70 ms). StarCoderBase-1B's 16 heads
# at 256 sequences (4,096 rows) went the other way (0.62 -> 0.79 ms: 512 programs are too few). A program's rows run
# one after another, so few rows (a small batch, where every program is in the first wave anyway) keep one each.
_REDUCE_MANY_ROWS = 8192  # (sequence, q head) rows from which programs take _REDUCE_ROWS_MANY each
_REDUCE_ROWS_MANY = 8


def reduce_rows(num_seqs: int, num_heads: int) -> int:
    """q heads each program of the split decode's reduce kernel combines (the same combine per row either way): 8
    from 8,192 (sequence, q head) rows, else 1. Host ints only; a CUDA graph fixes it per captured size (the
    warm-up's eager step of each size compiles both variants before any capture)."""
    override = os.environ.get(_REDUCE_ROWS_ENV)
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"{_REDUCE_ROWS_ENV} must be a positive integer, got {override!r}")
        return min(int(override), num_heads)
    return _REDUCE_ROWS_MANY if num_seqs * num_heads >= _REDUCE_MANY_ROWS else 1


# The fused reduce (REPLAYLLM_DECODE_FUSED_REDUCE=1, opt-in): a split decode's last program per (sequence, kv head)
# combines the splits' partials itself (a counter per pair, the threadfence-reduction pattern) instead of a second
# kernel: at batch 1, 28 reduce launches a step fewer, yet W4 did not move on the H200 (session 28: 0.892 / 0.892 ms
# against 0.889 / 0.904; under PDL the reduce kernel already ran in the attention's tail). Read once at import.
FUSED_REDUCE = env_flag("REPLAYLLM_DECODE_FUSED_REDUCE", default=False)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTERS_MIN = 4096  # (sequence, kv head) pairs the first allocation holds (16 KiB)


def decode_counters(device: torch.device, pairs: int) -> torch.Tensor | None:
    """The fused reduce's counters for `pairs` (sequence, kv head) pairs on `device`: a zeroed int32 buffer kept
    per device (each launch's last programs zero theirs again), so a CUDA graph captures one fixed pointer. None
    (the reduce kernel combines) when the fused reduce is off, or when the buffer must grow during a CUDA-graph
    capture (an allocation there would come from the graph's pool; the eager runs before a capture grow it).
    One engine per device: kernels of two streams running at once would share the counters."""
    if not FUSED_REDUCE:
        return None
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < pairs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTERS[device] = torch.zeros(max(pairs, _COUNTERS_MIN), dtype=torch.int32, device=device)
    return buf
