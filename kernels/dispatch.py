"""Where the fused decoder-layer kernels run: always on CUDA; on CPU only under the interpreter, when asked."""

from __future__ import annotations

import os
from functools import cache

import torch

# True: the fused kernels wherever they run; False: the torch references everywhere (an A/B switch on CUDA).
ENABLED = True
# Off by default, so the CPU engine keeps the plain-torch path (the interpreter is far too slow for CI).
# Tests set it (monkeypatch) to run the fused kernels on CPU under TRITON_INTERPRET=1.
INTERPRET_ON_CPU = False


def use_fused_kernels(device: torch.device) -> bool:
    """True on CUDA; on CPU only when INTERPRET_ON_CPU is set and the Triton interpreter is on; never when
    ENABLED is False."""
    if not ENABLED:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"


def triton_can_run(device: torch.device) -> bool:
    """Whether a Triton kernel can run on `device` at all: on CUDA, or on CPU under the interpreter
    (`TRITON_INTERPRET=1`, set before the first @triton.jit decorator runs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"



@cache
def max_shared_memory(device: torch.device) -> int | None:
    """Bytes of shared memory one block may use on this CUDA device (opt-in maximum: 227 KiB on an H100/H200,
    163 KiB on an A100, 99 KiB on sm_86/89); None off CUDA or where torch does not report it. Tiles measured on
    the H200 check it and fall back to smaller ones, chosen per device, never per call."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


def env_ints(name: str, fields: str) -> tuple[int, ...] | None:
    """A launch override read from the environment (REPLAYLLM_DECODE_TILE, REPLAYLLM_PREFILL_TILE): the positive
    ints of `fields` ("BLOCK_N,num_warps,num_stages"), comma-separated; None when unset; ValueError when malformed.
    Read at every launch, so a sweep can change it between calls."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        values = ()
    if len(values) != len(fields.split(",")) or min(values) < 1:
        raise ValueError(f"{name} must be '{fields}' (positive integers), got {text!r}")
    return values


def env_flag(name: str, default: bool = True) -> bool:
    """An A/B switch read from the environment (REPLAYLLM_GEMV, REPLAYLLM_PDL, ...): "1" is on, "0" off, unset
    `default`, anything else a ValueError."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
