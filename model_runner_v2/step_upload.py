"""StepUpload: a step's staged host writes (new requests' token ids, prompt lengths and sampling options, new blocks,
traces) on their way to the device in ONE pinned, non-blocking copy.

Each writer (sampling/staged_writes.py and its users) adds its host arrays with the write to run once they are on the
device; `flush` packs them into the next PinnedRing buffer (each array at an 8-byte boundary of an int64 buffer, its
bytes as they are), copies that buffer once, and runs the writes in add order on views of the device copy (a byte
slice viewed as the array's dtype and shape). Before session 23 every writer copied its own arrays, and the per-slot
ones with a plain `.to(device)`: that synchronises the CUDA stream, so each step that admitted a request waited for the
step before it to finish before it could launch (and ~40 small copies besides). Off CUDA the arrays are wrapped, not
copied (unless a ring is given: the tests drive the packed path on CPU with a stand-in)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .pinned_ring import PinnedRing

Part = tuple[list[np.ndarray], Callable[..., None]]  # host arrays, the write that takes them as device tensors


class StepUpload:
    def __init__(self, device: torch.device, ring=None):
        """ring: PinnedRing's `host_buffer(n)` / `send(n)` (None: a PinnedRing on CUDA, no copy elsewhere)."""
        self.device = device
        self.ring = ring if ring is not None else PinnedRing(device) if device.type == "cuda" else None
        self._parts: list[Part] = []

    def add(self, arrays: Sequence[np.ndarray], write: Callable[..., None]) -> None:
        self._parts.append(([np.ascontiguousarray(a) for a in arrays], write))

    def flush(self) -> None:
        """Copy everything added since the last flush and run the writes (nothing added: nothing happens)."""
        parts, self._parts = self._parts, []
        if not parts:
            return
        if self.ring is None:
            for arrays, write in parts:
                write(*(torch.from_numpy(a) for a in arrays))
            return
        total = sum(_words(a) for arrays, _ in parts for a in arrays)
        starts = pack(parts, self.ring.host_buffer(total))
        unpack(parts, starts, self.ring.send(total))


def _words(a: np.ndarray) -> int:
    return -(-a.nbytes // 8)


def pack(parts: list[Part], host: np.ndarray) -> list[int]:
    """Every array's bytes into host ([>= total words] int64), each from an 8-byte boundary; returns the start word
    of each array, in order."""
    raw = host.view(np.uint8)
    starts, at = [], 0
    for arrays, _ in parts:
        for a in arrays:
            raw[8 * at : 8 * at + a.nbytes] = a.reshape(-1).view(np.uint8)
            starts.append(at)
            at += _words(a)
    return starts


def unpack(parts: list[Part], starts: list[int], device_words: torch.Tensor) -> None:
    """Run each part's write on its arrays' views of device_words (the packed buffer on the device, int64)."""
    data = device_words.view(torch.uint8)
    k = 0
    for arrays, write in parts:
        views = []
        for a in arrays:
            start = 8 * starts[k]
            views.append(data[start : start + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape))
            k += 1
        write(*views)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
