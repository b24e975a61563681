"""Reading the paged KV cache in plain torch (the torch attention paths): a gather by slot that also reads fp8."""

from __future__ import annotations

import torch

from .rounding import fp8_code


def gather_kv(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_slots, Hkv, D] (one half of a layer's cache, any dtype) at slots (int64, any shape) -> [*slots.shape,
    Hkv, D] in `dtype`. An fp8 cache (EngineConfig.kv_cache_dtype) is gathered as bytes, since torch's index kernels
    lack fp8 on some devices, then converted: exactly, every fp8 value being a bf16/fp16/fp32 value."""
    if fp8_code(cache.dtype):
        return cache.view(torch.uint8)[slots].view(cache.dtype).to(dtype)
    return cache[slots].to(dtype)
