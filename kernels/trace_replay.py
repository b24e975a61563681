"""Trace replay: overwrite sampled tokens with each replaying request's trace token at its current step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import triton_can_run


@triton.jit
def _trace_replay_kernel(
    sampled_ptr,  # [num_rows] int64, written in place
    slots_ptr,  # [num_rows] int32|int64, batch row -> slot; < 0 marks a padding row
    total_len_ptr,  # [num_slots] int32, tokens so far (prompt + generated) per slot
    prompt_len_ptr,  # [num_slots] int32
    trace_ptr,  # [num_slots, trace_cols] int32
    trace_stride_slot,  # elements between two slots' trace rows
    trace_stride_col,  # elements between two steps of one trace row
    trace_cols,  # trace.shape[1]; steps at or past it are never read
    trace_len_ptr,  # [num_slots] int32, 0 = the slot does not replay
    step_offsets_ptr,  # [num_rows] int64, added to each row's step (fast replay); unused without HAS_OFFSETS
    HAS_OFFSETS: tl.constexpr,
):
    # One program per batch row.
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        step = tl.load(total_len_ptr + slot) - tl.load(prompt_len_ptr + slot)
        if HAS_OFFSETS:
            step = step + tl.load(step_offsets_ptr + row).to(tl.int32)
        n = tl.minimum(tl.load(trace_len_ptr + slot), trace_cols)
        # step < 0: a partial prefill (should not reach the sampler, but must be a no-op);
        # step >= n: the trace is exhausted, keep the sampled token.
        if (step >= 0) & (step < n):
            tok = tl.load(trace_ptr + slot * trace_stride_slot + step.to(tl.int64) * trace_stride_col)
            tl.store(sampled_ptr + row, tok.to(tl.int64))


def _check_inputs(
    sampled: torch.Tensor,
    slots: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    trace: torch.Tensor,
    trace_len: torch.Tensor,
    step_offsets: torch.Tensor | None = None,
) -> None:
    """Validate dtypes, shapes and devices; raises ValueError with the offending argument named."""
    if step_offsets is not None:
        if not isinstance(step_offsets, torch.Tensor) or step_offsets.dtype != torch.int64:
            raise ValueError("step_offsets must be an int64 torch.Tensor or None")
        if step_offsets.shape != sampled.shape or step_offsets.device != sampled.device:
            raise ValueError(f"step_offsets must match sampled's shape {tuple(sampled.shape)} and device, got "
                             f"{tuple(step_offsets.shape)} on {step_offsets.device}")
    tensors = {
        "sampled": sampled,
        "slots": slots,
        "total_len": total_len,
        "prompt_len": prompt_len,
        "trace": trace,
        "trace_len": trace_len,
    }
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    expected = {
        "sampled": (torch.int64,),
        "slots": (torch.int32, torch.int64),
        "total_len": (torch.int32,),
        "prompt_len": (torch.int32,),
        "trace": (torch.int32,),
        "trace_len": (torch.int32,),
    }
    for name, dtypes in expected.items():
        if tensors[name].dtype not in dtypes:
            want = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name} must be {want}, got {tensors[name].dtype}")
    for name, t in tensors.items():
        want_dim = 2 if name == "trace" else 1
        if t.dim() != want_dim:
            raise ValueError(f"{name} must be {want_dim}-D, got shape {tuple(t.shape)}")
    if slots.shape[0] != sampled.shape[0]:
        raise ValueError(
            f"slots has {slots.shape[0]} rows but sampled has {sampled.shape[0]}"
        )
    num_slots = trace.shape[0]
    for name in ("total_len", "prompt_len", "trace_len"):
        if tensors[name].shape[0] != num_slots:
            raise ValueError(
                f"{name} has {tensors[name].shape[0]} slots but trace has {num_slots} rows"
            )
    device = sampled.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but sampled is on {device}")


def trace_replay_triton(
    sampled: torch.Tensor,
    slots: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    trace: torch.Tensor,
    trace_len: torch.Tensor,
    step_offsets: torch.Tensor | None = None,
) -> None:
    """Triton launcher: `sampled[r] = trace[s, step]` where `s = slots[r] >= 0` and
    `0 <= step = total_len[s] - prompt_len[s] (+ step_offsets[r]) < trace_len[s]`; every other row is left as
    sampled.

    sampled [R] int64 (in place); slots [R] int32/int64; total_len, prompt_len, trace_len [S] int32;
    trace [S, L] int32; step_offsets [R] int64 or None (fast replay: several rows of one slot sample
    consecutive steps). Every slot in `slots` must be < S (not checked: that would need a host sync).
    """
    _check_inputs(sampled, slots, total_len, prompt_len, trace, trace_len, step_offsets)
    for name, t in (
        ("sampled", sampled),
        ("slots", slots),
        ("total_len", total_len),
        ("prompt_len", prompt_len),
        ("trace_len", trace_len),
        ("step_offsets", step_offsets if step_offsets is not None else sampled),
    ):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if not use_triton_trace_kernel(sampled.device):
        raise ValueError(
            f"the Triton trace kernel cannot run on {sampled.device}: it needs CUDA, or TRITON_INTERPRET=1 "
            "set before replayllm.kernels.trace_replay is imported; use trace_replay() to fall back to torch"
        )
    num_rows = sampled.shape[0]
    if num_rows == 0:
        return
    _trace_replay_kernel[(num_rows,)](
        sampled,
        slots,
        total_len,
        prompt_len,
        trace,
        trace.stride(0),
        trace.stride(1),
        trace.shape[1],
        trace_len,
        step_offsets if step_offsets is not None else sampled,  # a dummy pointer when HAS_OFFSETS is off
        HAS_OFFSETS=step_offsets is not None,
    )


def trace_replay_torch(
    sampled: torch.Tensor,
    slots: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    trace: torch.Tensor,
    trace_len: torch.Tensor,
    step_offsets: torch.Tensor | None = None,
) -> None:
    """Plain-torch reference of `trace_replay_triton` (same arguments, same in-place semantics).

    Vectorised with clamped gathers and `torch.where`: no Python loop over rows and no host sync.
    """
    _check_inputs(sampled, slots, total_len, prompt_len, trace, trace_len, step_offsets)
    num_rows, trace_cols = sampled.shape[0], trace.shape[1]
    if num_rows == 0 or trace_cols == 0:
        return
    slot = slots.long()  # [R]
    valid_slot = slot >= 0
    # Padding rows gather slot 0 and are masked out below; slots >= S are a caller bug and raise in
    # the gather (CPU) or trip a device assert (CUDA), as they would read out of bounds in the kernel.
    safe_slot = slot.clamp(min=0)
    step = (total_len[safe_slot] - prompt_len[safe_slot]).long()  # [R]
    if step_offsets is not None:
        step = step + step_offsets
    n = trace_len[safe_slot].long().clamp(max=trace_cols)  # [R]
    replay = valid_slot & (step >= 0) & (step < n)  # [R] bool, stays on device
    tok = trace[safe_slot, step.clamp(0, trace_cols - 1)].long()  # [R]
    sampled.copy_(torch.where(replay, tok, sampled))


def use_triton_trace_kernel(device: torch.device) -> bool:
    """True on CUDA; on CPU only when the Triton interpreter is on (`TRITON_INTERPRET=1`)."""
    return triton_can_run(device)


def trace_replay(
    sampled: torch.Tensor,
    slots: torch.Tensor,
    total_len: torch.Tensor,
    prompt_len: torch.Tensor,
    trace: torch.Tensor,
    trace_len: torch.Tensor,
    step_offsets: torch.Tensor | None = None,
) -> None:
    """Overwrite replaying rows of `sampled` in place, with the Triton kernel where it runs, else torch."""
    if use_triton_trace_kernel(sampled.device):
        trace_replay_triton(sampled, slots, total_len, prompt_len, trace, trace_len, step_offsets)
    else:
        trace_replay_torch(sampled, slots, total_len, prompt_len, trace, trace_len, step_offsets)
