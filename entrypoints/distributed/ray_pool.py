"""RayPool: data parallelism on Ray: one actor per replica, shards dispatched as replicas free up, a dead
replica's shards retried on the others, results merged in input order."""

from __future__ import annotations

import collections
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .jobs import OnShard, Shard
from .merge import Deliver, OrderedMerge
from .options import ScaleOut, import_ray
from .replica import Replica

# Shards queued on one replica at once: the next one is already there when the current one ends (no idle gap),
# and few enough that a dead replica leaves little to redo.
IN_FLIGHT_PER_REPLICA = 2
# Environment the actors need when they run on a cluster started elsewhere (a local one inherits it anyway).
FORWARDED_ENV = ("REPLAYLLM_CACHE_DIR", "HF_HOME", "HF_HUB_OFFLINE", "TRITON_INTERPRET", "TRANSFORMERS_OFFLINE",
                 "OMP_NUM_THREADS")  # set: the replicas run that many CPU threads (Ray: 1 otherwise)


class RayPool:
    """`data_parallel_size` Replica actors (num_gpus = tensor_parallel_size on CUDA, 0 on CPU; 1 CPU each).

    Joins `ray_address`, or the Ray session this process already has, or starts a local one (shut down again on
    exit; a session found already running is left as it was). `engine_seconds`: the replicas' time in their
    jobs (Replica.run, measured in the actors, summed over replicas; lost shards not counted).
    `after_result(pool)`, when set, is called after each shard result is received (tests use it to kill a
    replica mid-run, reading `in_flight` and `actors`)."""

    after_result: Callable[[RayPool], None] | None = None

    def __init__(self, scale_out: ScaleOut, model: str | None, engine_options: dict[str, Any]):
        self.scale_out, self.model, self.engine_options = scale_out, model, engine_options
        self.ray = import_ray()
        self.actors: list[Any] = []
        self.alive: list[bool] = []
        self.in_flight: dict[Any, tuple[int, Shard, int]] = {}  # object ref -> (replica, shard, attempt)
        self.retries = 0  # shards run again after their replica died
        self.engine_seconds = 0.0
        self._owns_session = False

    # -- life ----------------------------------------------------------------------------------------------
    def __enter__(self) -> RayPool:
        ray = self.ray
        if not ray.is_initialized():
            local = self.scale_out.ray_address is None
            ray.init(address=self.scale_out.ray_address, include_dashboard=False if local else None,
                     log_to_driver=True)
            self._owns_session = True
        try:
            self._start_actors()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_actors(self) -> None:
        ray, dp = self.ray, self.scale_out.data_parallel_size
        resources = ray.cluster_resources()
        gpus = self._gpus_per_replica(resources)
        if gpus and dp * gpus > resources.get("GPU", 0):
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={gpus} needs {dp * gpus} GPUs; the Ray "
                             f"cluster has {resources.get('GPU', 0):g}")
        if dp > resources.get("CPU", 0):
            raise ValueError(f"data_parallel_size={dp} replicas take 1 CPU each; the Ray cluster has "
                             f"{resources.get('CPU', 0):g}")
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        actor_class = ray.remote(Replica).options(num_cpus=1, num_gpus=gpus, max_restarts=0,
                                                  runtime_env={"env_vars": env} if env else None)
        self.actors = [actor_class.remote(self.model, self.engine_options) for _ in range(dp)]
        self.alive = [True] * dp
        try:  # wait for every engine: a bad option fails here, before any shard is sent
            self._max_num_seqs = ray.get([a.max_num_seqs.remote() for a in self.actors])[0]
        except ray.exceptions.RayError as e:
            raise ValueError(f"a replica could not start its engine: {_cause(e)}") from None

    def _gpus_per_replica(self, resources: dict) -> int:
        device = str(self.engine_options.get("device", "auto"))
        cuda = device.startswith("cuda") or (device == "auto" and resources.get("GPU", 0) > 0)
        return int(self.engine_options.get("tensor_parallel_size", 1)) if cuda else 0

    def __exit__(self, *exc) -> None:
        ray = self.ray
        for actor, alive in zip(self.actors, self.alive):
            if alive:
                try:
                    ray.get(actor.shutdown.remote(), timeout=120)
                except Exception:  # noqa: BLE001 -- it is killed next anyway
                    pass
            ray.kill(actor)
        self.actors, self.alive, self.in_flight = [], [], {}
        if self._owns_session:
            ray.shutdown()
            self._owns_session = False

    def resolved(self) -> dict[str, Any]:
        return self.ray.get(self.actors[self._live()[0]].resolved.remote())

    # -- work ----------------------------------------------------------------------------------------------
    def run(self, job, shards: Iterable[Shard], deliver: Deliver, on_shard: OnShard | None = None) -> None:
        ray = self.ray
        merge = OrderedMerge(deliver)
        fresh: Iterator[Shard] = iter(shards)
        retry: collections.deque[tuple[Shard, int]] = collections.deque()
        job_ref = ray.put(job)
        try:
            while True:
                self._fill(job_ref, fresh, retry)
                if not self.in_flight:
                    break
                [ref], _ = ray.wait(list(self.in_flight), num_returns=1)
                replica, shard, attempt = self.in_flight.pop(ref)
                try:
                    ran = ray.get(ref)
                except ray.exceptions.RayActorError as e:  # the replica died (killed, OOM, node lost)
                    self._lost(replica, shard, attempt, e, retry)
                    continue
                except ray.exceptions.RayTaskError as e:  # the job itself failed (a bad trace): not retried
                    raise _user_error(e) from None
                self.engine_seconds += ran.seconds
                merge.put(shard.index, ran.result)
                if on_shard is not None:
                    on_shard(shard)
                if self.after_result is not None:
                    self.after_result(self)
        finally:
            merge.close()
        if merge.waiting:
            raise RuntimeError(f"shards {sorted(merge.waiting)} never reached the output")

    def _fill(self, job_ref, fresh: Iterator[Shard], retry: collections.deque) -> None:
        """Give every live replica work up to IN_FLIGHT_PER_REPLICA shards (retries first)."""
        for replica in self._live():
            while sum(1 for i, _, _ in self.in_flight.values() if i == replica) < IN_FLIGHT_PER_REPLICA:
                if retry:
                    shard, attempt = retry.popleft()
                else:
                    shard, attempt = next(fresh, None), 1
                    if shard is None:
                        return
                ref = self.actors[replica].run.remote(job_ref, shard)
                self.in_flight[ref] = (replica, shard, attempt)

    def _lost(self, replica: int, shard: Shard, attempt: int, error: Exception, retry: collections.deque) -> None:
        self.alive[replica] = False
        if attempt >= self.scale_out.max_attempts:
            raise RuntimeError(f"shard {shard.index} (requests {shard.start}..{shard.start + len(shard) - 1}) lost "
                               f"its replica {attempt} times; last: {_cause(error)}")
        if not self._live():
            raise RuntimeError(f"every replica died; last: {_cause(error)}")
        self.retries += 1
        retry.append((shard, attempt + 1))

    def _live(self) -> list[int]:
        return [i for i, alive in enumerate(self.alive) if alive]


def _cause(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _user_error(error: Exception) -> Exception:
    """A job's own exception (ValueError for a bad trace) as the caller would get it without Ray."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, (ValueError, TypeError)):
        return type(cause)(str(cause))
    return RuntimeError(f"a replica failed: {_cause(error)}")
