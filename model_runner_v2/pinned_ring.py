"""PinnedRing: the pinned host buffers a step's packed inputs travel through, reused instead of pinned per step.

`tensor.pin_memory()` on every step's packed int64 inputs cost the host an allocation from the caching host
allocator, a copy into it and its bookkeeping, each step (W4, batch 1: the host is the bound of a decode step
once the GPU's part is ~0.9 ms). Here DEPTH pinned buffers are written in turn, straight from numpy; a buffer is
reused only once the copy that last read it is done (its event, recorded after that copy: long done DEPTH steps
later, so the wait costs a query)."""

from __future__ import annotations

import numpy as np
import torch

DEPTH = 4  # steps in flight at most before a buffer is reused (async scheduling keeps ~2)


class PinnedRing:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * DEPTH  # pinned int64, grown on demand
        self._events = [torch.cuda.Event() for _ in range(DEPTH)] if device.type == "cuda" else []
        self._recorded = [False] * DEPTH
        self._next = 0

    def host_buffer(self, n: int) -> np.ndarray:
        """[n] int64 host memory to fill with the step's packed inputs (then `send` or `send_into`): pinned on CUDA (the
        ring's next buffer, once its last copy is done), fresh elsewhere."""
        if self.device.type != "cuda":
            self._host = np.zeros(n, dtype=np.int64)
            return self._host
        i = self._next
        if self._recorded[i]:
            self._events[i].synchronize()  # the copy that last read this buffer has finished
        buf = self._buffers[i]
        if buf is None or buf.numel() < n:
            buf = self._buffers[i] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel()), 1024),
                                                 dtype=torch.int64, pin_memory=True)
        return buf[:n].numpy()

    def send_into(self, dest: torch.Tensor, n: int) -> None:
        """Copy the buffer `host_buffer(n)` returned into dest [n] int64 (a device buffer that stays put, such as a
        CUDA graph's static input): one non-blocking copy on CUDA (the current stream), a plain copy elsewhere."""
        if self.device.type != "cuda":
            dest.copy_(torch.from_numpy(self._host))
            return
        dest.copy_(self._buffers[self._next][:n], non_blocking=True)
        self._copy_issued()

    def send(self, n: int) -> torch.Tensor:
        """The buffer `host_buffer(n)` returned, on the device ([n] int64): one non-blocking copy on CUDA (the
        current stream), the host array itself elsewhere."""
        if self.device.type != "cuda":
            return torch.from_numpy(self._host)
        flat = self._buffers[self._next][:n].to(self.device, non_blocking=True)
        self._copy_issued()
        return flat

    def _copy_issued(self) -> None:
        """The current buffer's copy is on the stream: mark it with an event, move to the next buffer."""
        i = self._next
        self._events[i].record()
        self._recorded[i] = True
        self._next = (i + 1) % DEPTH
