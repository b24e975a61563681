"""OrderedMerge: shard results arrive in any order and leave in input order; early ones wait on disk."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

Deliver = Callable[[int, Any], None]  # (shard index, result), called in input order


class OrderedMerge:
    """`put(index, result)` in any order; `deliver(index, result)` is called for shards 0, 1, 2, ... in order,
    each exactly once. A result with `save(path)` and `load(path)` (TokenColumns) that arrives early waits in a
    temporary file, so only the shard being written is in memory; others (lists of records) wait in memory."""

    def __init__(self, deliver: Deliver):
        self.deliver = deliver
        self.next = 0
        self.waiting: dict[int, Any] = {}  # index -> result, or the path of its spilled file
        self._tmp: tempfile.TemporaryDirectory | None = None

    def put(self, index: int, result: Any) -> None:
        if index < self.next or index in self.waiting:
            raise RuntimeError(f"shard {index} delivered twice")  # the pool retries only shards it lost
        if index != self.next:
            self.waiting[index] = self._spill(index, result)
            return
        self.deliver(index, result)
        self.next += 1
        while self.next in self.waiting:
            self.deliver(self.next, self._unspill(self.waiting.pop(self.next)))
            self.next += 1

    def _spill(self, index: int, result: Any) -> Any:
        if not hasattr(result, "save"):
            return result
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="replayllm-shards-")
        path = os.path.join(self._tmp.name, f"shard-{index}.npz")
        result.save(path)
        return _Spilled(path, type(result))

    @staticmethod
    def _unspill(item: Any) -> Any:
        if not isinstance(item, _Spilled):
            return item
        result = item.kind.load(item.path)
        os.remove(item.path)
        return result

    def close(self) -> None:
        self.waiting.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class _Spilled:
    def __init__(self, path: str, kind: type):
        self.path, self.kind = path, kind
