"""Replica: one engine (LLM) that runs jobs on shards; a Ray actor under data parallelism, a plain object without."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Ran:
    """One shard's result and the seconds `job.run` took inside the replica (the engine's share of a run: the
    rest of the pool's time is reading, dispatch, Ray's transfers, merging and writing)."""

    result: Any
    seconds: float


class Replica:
    """Holds `LLM(model, **engine_options)` for its whole life; `run(job, shard)` is one shard's work."""

    def __init__(self, model: str | None, engine_options: dict[str, Any]):
        from replayllm.entrypoints.llm import LLM

        self.llm = LLM(model, **engine_options)

    def resolved(self) -> dict[str, Any]:
        """What this replica's engine resolved to (dtype, device, ...; see diff/resolved.py)."""
        from ..diff.resolved import engine_resolved

        return engine_resolved(self.llm.llm_engine.config)

    def max_num_seqs(self) -> int:
        return self.llm.llm_engine.config.max_num_seqs

    def run(self, job, shard) -> Ran:
        start = time.perf_counter()
        result = job.run(self.llm, shard)
        return Ran(result, time.perf_counter() - start)

    def shutdown(self) -> None:
        """Stop tensor-parallel workers (a no-op otherwise) and free the engine's memory."""
        from ..diff.sides import free_device_memory

        self.llm.llm_engine.shutdown()
        del self.llm
        free_device_memory()
