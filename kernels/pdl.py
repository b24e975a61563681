"""Programmatic dependent launch (PDL): a decode step's small kernels start before the kernel ahead of them ends.

A batch-1 decode step is ~255 launches of 1-7 us each (Qwen3-0.6B); between two kernels in a stream the GPU drains
the first grid, then schedules the next one's programs, which only then issue their first loads: ~1-2 us a
boundary with the SMs mostly idle. On sm_90+ a kernel launched with PDL (Triton's `launch_pdl`) may be scheduled
while its predecessor still runs (once every program of the predecessor has called `gdc_launch_dependents` or
exited). Its programs must then call `gdc_wait()` before reading anything an earlier kernel wrote, or writing
anything an earlier kernel reads: the wait returns once every earlier kernel of the stream has completed and
its writes are visible (it is a no-op in a launch without PDL). What they may do before it: read data no kernel
of the step writes (the weights: kernels/gemv.py loads its first weight chunk there). CUDA graphs capture the
launches as programmatic edges, so replays keep the overlap.

The rule every PDL kernel here keeps: `gdc_wait()` before its first access to activations, KV cache or any
buffer another kernel touches, unconditionally (a kernel that skipped it could complete before its predecessor,
and the kernel after it would then wait on the wrong one). Kernels: the GEMV (kernels/gemv.py), q/k norm + rope
(kernels/rotary.py), the KV-cache write (kernels/kv_cache_write.py), decode attention and its reduce
(kernels/paged_attention.py), the sampled-token append (kernels/append_sampled.py). REPLAYLLM_PDL=0 launches them
all as ordinary kernels (an A/B switch).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .dispatch import env_flag

try:  # Triton >= 3.4 (griddepcontrol.wait / launch_dependents: no-ops in a launch without PDL)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off (`pdl_supported`)
    gdc_launch_dependents = gdc_wait = None

ENV = "REPLAYLLM_PDL"
ENABLED = env_flag(ENV)  # read once at import


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels launch with PDL on `device`: NVIDIA CUDA sm_90+ (Hopper's griddepcontrol; not ROCm), a
    Triton that has it (the `launch_pdl` option and gdc_wait), not under the interpreter, not switched off
    (REPLAYLLM_PDL=0)."""
    device = torch.device(device)
    if not ENABLED or device.type != "cuda" or gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.version.hip is not None:  # ROCm reports "cuda" devices (and an MI300 capability 9.4): no griddepcontrol
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - no NVIDIA backend
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """A kernel launch's PDL arguments on `device`: the kernel's `PDL` constexpr and Triton's launch option."""
    if pdl_supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """A PDL kernel's first statement (kernels with nothing to read early): wait for every earlier kernel of the
    stream, then let the next PDL launch be scheduled. Nothing without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
