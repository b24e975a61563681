"""How the paged prefill-attention kernel is launched: query tokens per program and its tile (GPU-measured choices,
with an override for sweeps and A/B runs)."""

from __future__ import annotations

import torch
import triton

from .dispatch import env_ints

_PREFILL_TILE_ENV = "REPLAYLLM_PREFILL_TILE"  # "BLOCK_Q,BLOCK_N,num_warps,num_stages": overrides the defaults below


def prefill_override() -> tuple[int, ...] | None:
    """(block_q, BLOCK_N, num_warps, num_stages) from REPLAYLLM_PREFILL_TILE, or None when unset (a malformed value
    is a ValueError)."""
    return env_ints(_PREFILL_TILE_ENV, "BLOCK_Q,BLOCK_N,num_warps,num_stages")


def prefill_block_q(max_query_len: int, group_pad: int) -> int:
    """Query tokens per program: 16..64 rows of (token, q head) pairs (tl.dot needs M >= 16), fewer tokens for
    wider GQA groups, no more than the step's longest query needs."""
    return min(max(triton.next_power_of_2(max_query_len), max(1, 16 // group_pad)), max(1, 64 // group_pad))


def prefill_tile(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). fp32 tiles: [64 rows, 32 keys] on 8 warps. ptxas -v for sm_90 reports
    35 KB of spill stores with [64, 64] on 4 warps (that build measured 10x slower than torch on the H200), 0.4 KB
    with this one; bf16 keeps the measured [64, 64] on 4 warps (session 20 measured [64, 32] 10-15% faster on a
    16 x 512-token prefill alone: `S1-engine-ptile` in bench/gpu_check.sh is the end-to-end A/B)."""
    fp32 = dtype == torch.float32
    return (32 if fp32 or head_dim > 128 else 64, 8 if fp32 else 4, 3)
