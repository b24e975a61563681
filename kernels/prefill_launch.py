"""How the paged prefill-attention kernel is launched: query tokens per program and its tile (GPU-measured choices,
with an override for sweeps and A/B runs), and its flat grid of query blocks (the host bound, the device search)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dispatch import env_ints

_PREFILL_TILE_ENV = "REPLAYLLM_PREFILL_TILE"  # "BLOCK_Q,BLOCK_N,num_warps,num_stages": overrides the defaults below
# "auto" (default): the numbering with fewer programs; "flat" / "request": that one always (`prefill_grid`). Both give
# the same bits, so this is a pure speed A/B (bench/gpu_check.sh's S1-engine-reqgrid row). Read at every launch.
_PREFILL_GRID_ENV = "REPLAYLLM_PREFILL_GRID"
_NUMBERINGS = ("auto", "flat", "request")


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


def prefill_grid(num_tokens: int, num_reqs: int, max_query_len: int, block_q: int) -> tuple[int, int]:
    """(programs per kv head, blocks_per_req) of a prefill launch. Two ways to number its (request, query block)
    pairs, the same programs either way (their arithmetic, hence their bits, do not change):
    - by request: B x cdiv(max_query_len, block_q) programs, program p = (p // that, p % that): no search, and
      nothing spare when the rows have one length (decode steps, uniform verify or prefill steps);
    - flat (blocks_per_req = 0): num_tokens // block_q + num_reqs programs, each finding its pair with
      `find_query_block`; at most one spare a request, where the first numbering leaves a mixed step's decode
      rows ~15 of 16 programs empty beside 512-token prompts (H200, session 20: 0.254 against 0.159 ms).
    The fewer programs wins, unless REPLAYLLM_PREFILL_GRID names one. Host ints only: no device sync; a CUDA graph
    keeps the numbering of its capture, valid while no row outgrows the captured max_query_len (as the grid always
    needed; the flat one holds for any lengths of the captured token count)."""
    numbering = os.environ.get(_PREFILL_GRID_ENV) or "auto"
    if numbering not in _NUMBERINGS:
        raise ValueError(f"{_PREFILL_GRID_ENV} must be one of {', '.join(_NUMBERINGS)}, got {numbering!r}")
    per_req = triton.cdiv(max_query_len, block_q)
    flat = num_tokens // block_q + num_reqs
    by_request = numbering == "request" or (numbering == "auto" and num_reqs * per_req <= flat)
    return (num_reqs * per_req, per_req) if by_request else (flat, 0)


@triton.jit
def find_query_block(query_start_loc_ptr, num_reqs, blocks_per_req, pid, BLOCK_Q: tl.constexpr):
    """(request, query block) of program `pid` of `prefill_grid`'s numbering. Flat (blocks_per_req == 0): request
    r owns [first(r), first(r + 1)) with first(r) = query_start_loc[r] // BLOCK_Q + r, which holds its
    cdiv(q_len, BLOCK_Q) blocks (first(r + 1) - first(r) = floor(end / BQ) - floor(start / BQ) + 1 >=
    cdiv(end - start, BQ) for a non-empty query); a binary search finds the last r with first(r) <= pid. A
    query block past the request's query is a spare (the kernel returns)."""
    if blocks_per_req > 0:
        req = pid // blocks_per_req
        q_block = pid % blocks_per_req
    else:
        lo = pid * 0
        hi = pid * 0 + num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = (tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid).to(tl.int32)
            lo = tl.where(first <= pid, mid, lo)
            hi = tl.where(first <= pid, hi, mid - 1)
        req = lo
        q_block = pid - (tl.load(query_start_loc_ptr + lo) // BLOCK_Q + lo).to(tl.int32)
    return req, q_block
