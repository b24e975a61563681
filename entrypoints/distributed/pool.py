"""Replica pools: run a job over shards on one in-process engine (LocalPool) or on Ray actors (RayPool, in
ray_pool.py); results reach `deliver` in input order either way."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .jobs import OnShard, Shard
from .merge import Deliver, OrderedMerge
from .options import ScaleOut
from .replica import Replica


def make_pool(scale_out: ScaleOut, model: str | None, engine_options: dict[str, Any]):
    """The pool for these options: RayPool with several replicas or a Ray address, else LocalPool (no Ray)."""
    if scale_out.uses_ray:
        from .ray_pool import RayPool

        return RayPool(scale_out, model, engine_options)
    return LocalPool(model, engine_options)


def default_max_num_seqs(engine_options: dict[str, Any]) -> int:
    from replayllm.config import EngineConfig

    return engine_options.get("max_num_seqs") or EngineConfig.max_num_seqs


class LocalPool:
    """One engine in this process: shards run one after another, in order. `engine_seconds`: the time spent in
    the engine's jobs (Replica.run), as RayPool's."""

    def __init__(self, model: str | None, engine_options: dict[str, Any]):
        self.model, self.engine_options = model, engine_options
        self.replica: Replica | None = None
        self.engine_seconds = 0.0

    def __enter__(self) -> LocalPool:
        self.replica = Replica(self.model, self.engine_options)
        return self

    def __exit__(self, *exc) -> None:
        if self.replica is not None:
            self.replica.shutdown()
            self.replica = None

    def resolved(self) -> dict[str, Any]:
        return self.replica.resolved()

    def run(self, job, shards: Iterable[Shard], deliver: Deliver, on_shard: OnShard | None = None) -> None:
        merge = OrderedMerge(deliver)
        for shard in shards:
            ran = self.replica.run(job, shard)
            self.engine_seconds += ran.seconds
            merge.put(shard.index, ran.result)
            if on_shard is not None:
                on_shard(shard)
        if merge.waiting:
            raise RuntimeError(f"shards {sorted(merge.waiting)} never reached the output")
