"""MoE "align": group the T*k (token, choice) copies by expert on the device, without a host sync.

The grouped-GEMM kernels (kernels/fused_moe.py) work on blocks of BLOCK_M rows that all belong to one expert. The
copies are sorted by expert (stable: within an expert, copies keep their order c = t*k + j) and each expert's group
is padded to a multiple of BLOCK_M. Every size is fixed by (T, k, E, BLOCK_M) alone, so the result can live in a
CUDA graph:

- at most T*k + E*(BLOCK_M - 1) padded rows (each expert wastes < BLOCK_M), rounded up to whole blocks:
  `max_blocks = cdiv(T*k + E*(BLOCK_M - 1), BLOCK_M)`;
- `sorted_ids` [max_blocks * BLOCK_M] int32: the copy id in each padded row, T*k (the sentinel) in padding rows
  and past the real count;
- `block_expert` [max_blocks] int32: the expert of each block; E for blocks past the real count;
- `num_rows` [1] int32: the real padded row count (sum over experts of the padded group sizes), which the
  kernels read from device memory to let blocks past it return at once.

Only torch ops that need no host sync are used: scatter_add_ (not bincount, which reads the max on the host on
CUDA), cumsum, a stable argsort, gathers, scatter_ and searchsorted. No `.item()`, `.tolist()`, nonzero or boolean
mask indexing. Expert ids must lie in [0, E) (not checked: checking would read them on the host).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class MoeAlignment(NamedTuple):
    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32: copy id (t*k + j) per padded row, T*k = padding
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each block, E past the real rows
    num_rows: torch.Tensor  # [1] int32: padded rows actually used (a multiple of block_m)
    block_m: int


def max_padded_blocks(num_copies: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the number of BLOCK_M blocks: cdiv(T*k + E*(BLOCK_M - 1), BLOCK_M)."""
    return -(-(num_copies + num_experts * (block_m - 1)) // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, k] integer expert ids in [0, E) -> MoeAlignment (see the module docstring). No host sync."""
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64, torch.int16):
        raise ValueError(f"topk_ids must be [T, k] int16/int32/int64, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts} and {block_m}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # copy c = token c // k, choice c % k
    num_copies = flat.numel()
    max_blocks = max_padded_blocks(num_copies, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # copies per expert
    padded = (counts + (block_m - 1)) // block_m * block_m  # each group rounded up to whole blocks
    padded_end = padded.cumsum(0)  # inclusive: expert e's padded rows are [padded_end[e] - padded[e], padded_end[e])
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts  # exclusive: where expert e's copies start in the sorted order

    order = torch.argsort(flat, stable=True)  # copies grouped by expert, in copy order within an expert
    expert_of_sorted = flat[order]
    rank = torch.arange(num_copies, device=dev) - start[expert_of_sorted]  # position inside the expert's group
    dest = padded_start[expert_of_sorted] + rank
    sorted_ids = torch.full((max_blocks * block_m,), num_copies, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))

    block_first_row = torch.arange(max_blocks, device=dev, dtype=torch.int64) * block_m
    # The expert whose padded range holds the block's first row; E for blocks past the last expert's end.
    block_expert = torch.searchsorted(padded_end, block_first_row, right=True).to(torch.int32)
    num_rows = padded_end[-1:].to(torch.int32)
    return MoeAlignment(sorted_ids, block_expert, num_rows, block_m)
