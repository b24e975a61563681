"""The GPU properties the kernel launchers size their grids by (the SM count), read once per device."""

from __future__ import annotations

import torch

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (132 on an H200); None off CUDA (the interpreter has no SMs:
    launchers keep their CPU rule there, and tests pass a count of their own)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]
