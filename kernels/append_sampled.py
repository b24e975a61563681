"""Appending a step's sampled tokens to the slots' token buffers, on the device, in one launch.

After sampling, each sampled row's token goes to its slot's token buffer at the slot's length, and the length
grows by one: the next step gathers its input ids there without a host round trip (async scheduling). In torch
that is ~8 small ops (gather the lengths, cast, scatter the tokens, cast, gather, add, scatter the lengths), each a
launch and a few µs of host time a step (~80 µs in all on the H200's host, cProfile); the kernel is one launch.
One sampled position per row (a fast-replay or speculative step, several positions per row, keeps the torch path:
model_runner_v2/request_states.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import env_flag
from .pdl import pdl_options, wait_for_predecessor

# On by default where the fused kernels run (CUDA); REPLAYLLM_APPEND_KERNEL=0 keeps the torch ops (an A/B switch:
# bench/gpu_check.sh's W4-noappend row). Session 19: W4 0.92-1.00 ms with it against 1.11-1.49 without, same call.
ENABLED = env_flag("REPLAYLLM_APPEND_KERNEL", default=True)


@triton.jit
def _append_sampled_kernel(
    token_ids_ptr,  # [num_slots, max_len] int32
    total_len_ptr,  # [num_slots] int32
    slots_ptr,  # [R] int64, distinct slots
    sampled_ptr,  # [R] int64
    max_len,
    stride_slot,  # token_ids' row stride (elements)
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py)
):
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    pos = tl.load(total_len_ptr + slot)
    token = tl.load(sampled_ptr + row).to(tl.int32)
    tl.store(token_ids_ptr + slot * stride_slot + pos, token, mask=pos < max_len)  # a full buffer keeps its tokens
    tl.store(total_len_ptr + slot, pos + 1)


def _check(token_ids: torch.Tensor, total_len: torch.Tensor, slots: torch.Tensor, sampled: torch.Tensor) -> None:
    if token_ids.dim() != 2 or token_ids.dtype != torch.int32 or token_ids.stride(1) != 1:
        raise ValueError(f"token_ids must be int32 [num_slots, max_len] with unit column stride, got "
                         f"{token_ids.dtype} {tuple(token_ids.shape)}")
    if total_len.dtype != torch.int32 or tuple(total_len.shape) != (token_ids.shape[0],):
        raise ValueError(f"total_len must be int32 [{token_ids.shape[0]}], got {total_len.dtype} "
                         f"{tuple(total_len.shape)}")
    if slots.dtype != torch.int64 or slots.dim() != 1 or sampled.shape != slots.shape:
        raise ValueError(f"slots must be int64 [R] and sampled [R], got {slots.dtype} {tuple(slots.shape)} and "
                         f"{tuple(sampled.shape)}")


def append_sampled_triton(token_ids: torch.Tensor, total_len: torch.Tensor, slots: torch.Tensor,
                          sampled: torch.Tensor) -> None:
    """token_ids[slots[r], total_len[slots[r]]] = sampled[r]; total_len[slots[r]] += 1, for distinct slots
    (one launch, R programs). Numerics: `append_sampled_torch`'s (integers: exact)."""
    _check(token_ids, total_len, slots, sampled)
    if slots.shape[0] == 0:
        return
    _append_sampled_kernel[(slots.shape[0],)](
        token_ids, total_len, slots.contiguous(), sampled.contiguous(), token_ids.shape[1], token_ids.stride(0),
        **pdl_options(token_ids.device),
    )


def append_sampled_torch(token_ids: torch.Tensor, total_len: torch.Tensor, slots: torch.Tensor,
                         sampled: torch.Tensor) -> None:
    """Plain-torch reference (and the CPU path)."""
    _check(token_ids, total_len, slots, sampled)
    pos = total_len[slots].long()
    token_ids[slots, pos] = sampled.to(torch.int32)
    total_len[slots] += 1
