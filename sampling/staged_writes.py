"""Host-staged writes into persistent per-slot device tensors, applied once per step."""

from __future__ import annotations

import numpy as np
import torch


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

    def apply(self) -> None:
        if not self._rows:
            return
        rows = torch.from_numpy(np.concatenate(self._rows)).to(self.tensor.device, non_blocking=True)
        cols = torch.from_numpy(np.concatenate(self._cols)).to(self.tensor.device, non_blocking=True)
        vals = torch.from_numpy(np.concatenate(self._vals)).to(self.tensor.device, non_blocking=True)
        self.tensor.index_put_((rows, cols), vals.to(self.tensor.dtype))
        self._rows.clear()
        self._cols.clear()
        self._vals.clear()


class StagedSlotWrites:
    """Stages `tensor[slot] = value` for a 1-D per-slot device tensor, mirrored on the host in `self.host`.

    The host mirror lets the runner decide on the host (no device sync) whether a step is needed, e.g.
    "no request in this batch uses top_p: skip".
    """

    def __init__(self, tensor: torch.Tensor, host_dtype=None):
        assert tensor.dim() == 1
        self.tensor = tensor
        np_dtype = host_dtype or torch.empty(0, dtype=tensor.dtype).numpy().dtype
        self.host = np.zeros(tensor.shape[0], dtype=np_dtype)
        self._pending: dict[int, float | int] = {}

    def stage(self, slot: int, value) -> None:
        self.host[slot] = value
        self._pending[slot] = value

    def apply(self) -> None:
        if not self._pending:
            return
        slots = torch.tensor(list(self._pending.keys()), dtype=torch.int64)
        vals = torch.tensor(list(self._pending.values()), dtype=self.tensor.dtype)
        self.tensor.index_put_((slots.to(self.tensor.device),), vals.to(self.tensor.device))
        self._pending.clear()
