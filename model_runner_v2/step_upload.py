"""StepUpload: a step's staged host writes (new requests' token ids, prompt lengths and sampling options, new blocks,
traces) on their way to the device in ONE pinned, non-blocking copy.

Each writer (sampling/staged_writes.py and its users) adds its host arrays with the write to run once they are on the
device; `flush` packs them all into the next PinnedRing buffer, copies it once (`PinnedRing.upload`, the packing the
step's inputs use too) and runs the writes in add order on views of the device copy. Before session 23 every writer
copied its own arrays, and the per-slot ones with a plain `.to(device)`: that synchronises the CUDA stream, so each
step that admitted a request waited for the step before it to finish before it could launch (and ~40 small copies
besides)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from .pinned_ring import PinnedRing


class StepUpload:
    def __init__(self, device: torch.device, ring: PinnedRing | None = None):
        self.ring = ring or PinnedRing(device)  # off CUDA the ring wraps host arrays: the same packing, no copy
        self._parts: list[tuple[int, Callable[..., None]]] = []  # per write: how many arrays it takes
        self._arrays: list[np.ndarray] = []

    def add(self, arrays: Sequence[np.ndarray], write: Callable[..., None]) -> None:
        self._parts.append((len(arrays), write))
        self._arrays.extend(arrays)

    def flush(self) -> None:
        """Copy everything added since the last flush (PinnedRing.upload) and run the writes in add order (nothing
        added: nothing happens)."""
        parts, arrays = self._parts, self._arrays
        if not parts:
            return
        self._parts, self._arrays = [], []
        tensors = iter(self.ring.upload(arrays))
        for count, write in parts:
            write(*(next(tensors) for _ in range(count)))
