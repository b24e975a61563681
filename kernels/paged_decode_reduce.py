"""The split decode's reduce kernel (kernels/paged_attention.py launches it where no fused reduce runs): every
split's partial output rescaled to the global running max and normalised, per (sequence, q head)."""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_tile import combine_splits, load_sink
from .pdl import wait_for_predecessor


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_reduce_kernel(
    out_ptr,  # [B, Hq, D], written (like the prefill kernel's out)
    part_acc_ptr,  # [B, Hq, num_splits, D] fp32
    part_ml_ptr,  # [B, Hq, num_splits, 2] fp32
    sinks_ptr,  # SINKS: [Hq]
    num_splits,
    stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,  # a programmatic dependent launch (kernels/pdl.py)
    NUM_HEADS: tl.constexpr,  # Hq
    ROWS: tl.constexpr = 1,  # q heads per program (decode_launch.reduce_rows)
    SINKS: tl.constexpr = False,
):
    # One program per (sequence, ROWS q heads): rescale every split's partial to the global max and normalise,
    # row by row (the same combine per row whatever ROWS is: the rows' loads are independent, so a program with
    # several keeps more in flight instead of one short-lived program per row).
    wait_for_predecessor(PDL)
    req = tl.program_id(0)
    for r in tl.static_range(ROWS):
        head = tl.program_id(1) * ROWS + r
        if head < NUM_HEADS:
            sink = 0.0
            if SINKS:
                sink = load_sink(sinks_ptr, head, head >= 0)
            combine_splits(out_ptr, part_acc_ptr, part_ml_ptr, req.to(tl.int64) * NUM_HEADS + head,
                           req.to(tl.int64) * stride_ot + head * stride_oh, num_splits, SPLITS_PAD, HEAD_DIM,
                           HEAD_DIM_PAD, False, sink, SINKS)
