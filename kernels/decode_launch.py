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


def decode_min_split_len(num_seqs: int, num_kv_heads: int, sm_count: int | None) -> int:
    """Fewest keys in a non-empty context chunk: DECODE_MIN_SPLIT_LEN, or the small-batch minimum when the
    (sequence, kv head) pairs are fewer than the SMs. `sm_count`: kernels/device_info.py (None off CUDA: the
    large-batch rule)."""
    if sm_count is None or num_seqs * num_kv_heads >= sm_count:
        return DECODE_MIN_SPLIT_LEN
    override = os.environ.get(_SMALL_SPLIT_ENV)
    if not override:
        return DECODE_SMALL_BATCH_MIN_SPLIT_LEN
    if not override.isdigit() or int(override) < 1:
        raise ValueError(f"{_SMALL_SPLIT_ENV} must be a positive integer, got {override!r}")
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


def decode_tile(dtype: torch.dtype, head_dim: int, num_programs: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel. fp32 and head_dim > 128 keep [.., 32] tiles on 8
    warps (sm_90: larger fp32 tiles spill registers, see paged_prefill_attention_triton)."""
    override = env_ints(_DECODE_TILE_ENV, "BLOCK_N,num_warps,num_stages")
    if override is not None:
        return override
    if dtype == torch.float32 or head_dim > 128:
        return 32, 8, 3
    return _DECODE_TILE_NARROW if num_programs >= _NARROW_MIN_PROGRAMS else _DECODE_TILE_WIDE


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
