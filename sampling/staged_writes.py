"""Host-staged writes into persistent per-slot device tensors, applied once per step.

`apply(upload)` hands the staged host arrays to an `Upload` with the write to run once they are on the device:
the runner's (model_runner_v2/step_upload.py) packs every writer's arrays of a step into one pinned buffer and
copies it with one non-blocking copy, so a step that admits requests never waits for the step before it (a plain
`.to(device)` of a CPU tensor synchronises the stream: it did, in every such step, until session 23).
`DirectUpload` copies each writer's arrays at once (non-blocking), for callers without a step's upload."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch


class Upload(Protocol):
    def add(self, arrays: Sequence[np.ndarray], write: Callable[..., None]) -> None:
        """`write(*tensors)` runs with each host array as a device tensor of its dtype and shape, in add order."""


class DirectUpload:
    """Each add's arrays copied to `device` at once (non-blocking, from pageable memory), then written."""

    def __init__(self, device: torch.device):
        self.device = device

    def add(self, arrays: Sequence[np.ndarray], write: Callable[..., None]) -> None:
        write(*(torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True) for a in arrays))


class StagedRowWrites:
    """Stages `tensor[row, start:start+len(values)] = values` for a 2-D device tensor.

    Writes accumulate on the host during scheduling; `apply()` turns them into one index tensor and one value
    tensor (one host->device copy each) and a single `index_put_`, so the device sees one write per step.
    """

    def __init__(self, tensor: torch.Tensor):
        assert tensor.dim() == 2
        self.tensor = tensor
        self._rows: list[np.ndarray] = []
        self._cols: list[np.ndarray] = []
        self._vals: list[np.ndarray] = []

    def stage(self, row: int, start: int, values) -> None:
        vals = np.asarray(values, dtype=np.int64).reshape(-1)
        if vals.size == 0:
            return
        self._rows.append(np.full(vals.size, row, dtype=np.int64))
        self._cols.append(np.arange(start, start + vals.size, dtype=np.int64))
        self._vals.append(vals)

    def apply(self, upload: Upload | None = None) -> None:
        if not self._rows:
            return
        arrays = [np.concatenate(self._rows), np.concatenate(self._cols), np.concatenate(self._vals)]  # int64 each
        self._rows.clear()
        self._cols.clear()
        self._vals.clear()

        def write(rows: torch.Tensor, cols: torch.Tensor, vals: torch.Tensor) -> None:
            self.tensor.index_put_((rows, cols), vals.to(self.tensor.dtype))

        (upload or DirectUpload(self.tensor.device)).add(arrays, write)


class StagedSlotWrites:
    """Stages `tensor[slot] = value` for a 1-D per-slot device tensor, mirrored on the host in `self.host`.

    The host mirror lets the runner decide on the host (no device sync) whether a step is needed, e.g.
    "no request in this batch uses top_p: skip".
    """

    def __init__(self, tensor: torch.Tensor, host_dtype=None):
        assert tensor.dim() == 1
        self.tensor = tensor
        self._np_dtype = torch.empty(0, dtype=tensor.dtype).numpy().dtype
        self.host = np.zeros(tensor.shape[0], dtype=host_dtype or self._np_dtype)
        self._pending: dict[int, float | int] = {}

    def stage(self, slot: int, value) -> None:
        self.host[slot] = value
        self._pending[slot] = value

    def apply(self, upload: Upload | None = None) -> None:
        if not self._pending:
            return
        slots = np.fromiter(self._pending.keys(), dtype=np.int64, count=len(self._pending))
        vals = np.array(list(self._pending.values()), dtype=self._np_dtype)  # rounded as torch.tensor(...) would
        self._pending.clear()

        def write(slots: torch.Tensor, vals: torch.Tensor) -> None:
            self.tensor.index_put_((slots,), vals)

        (upload or DirectUpload(self.tensor.device)).add([slots, vals], write)
