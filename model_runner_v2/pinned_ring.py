"""PinnedRing: the pinned host buffers a step's packed inputs travel through, reused instead of pinned per step.

`tensor.pin_memory()` on every step's packed int64 inputs cost the host an allocation from the caching host
allocator, a copy into it and its bookkeeping, each step (W4, batch 1: the host is the bound of a decode step
once the GPU's part is ~0.9 ms). Here DEPTH pinned buffers are written in turn, straight from numpy; a buffer is
reused only once the copy that last read it is done (its event, recorded after that copy: long done DEPTH steps
later, so the wait costs a query)."""

from __future__ import annotations

from collections.abc import Sequence

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

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Host arrays of any dtype and shape -> device tensors of the same dtype and shape, all in one copy: each
        array's bytes packed from a 16-byte boundary of the next buffer (Triton specialises a pointer argument on
        16-byte alignment: a part's pointer must not change kind with the sizes before it, input_batch.py), the
        device copy then viewed part by part. The views stay valid as long as they are referenced."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        words = [-(-a.nbytes // _ALIGN_BYTES) * (_ALIGN_BYTES // 8) for a in arrays]  # int64 words each takes
        starts = np.concatenate(([0], np.cumsum(words, dtype=np.int64))).tolist()
        raw = self.host_buffer(starts[-1]).view(np.uint8)
        for a, start in zip(arrays, starts):
            raw[8 * start : 8 * start + a.nbytes] = a.reshape(-1).view(np.uint8)
        data = self.send(starts[-1]).view(torch.uint8)
        return [data[8 * start : 8 * start + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
                for a, start in zip(arrays, starts)]

    def _copy_issued(self) -> None:
        """The current buffer's copy is on the stream: mark it with an event, move to the next buffer."""
        i = self._next
        self._events[i].record()
        self._recorded[i] = True
        self._next = (i + 1) % DEPTH


_ALIGN_BYTES = 16
_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    if dtype not in _TORCH_DTYPES:
        _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return _TORCH_DTYPES[dtype]
