"""Tensor-parallel process management: rank 0 (the engine process) drives one spawned worker per extra rank.

Every rank owns a full `ModelRunner` built inside `tensor_parallel(rank, size)`, so its layers hold only that
rank's shard (models/parallel.py) and its KV cache only that rank's KV heads. Rank 0 sends each of a step's two
calls down a pipe to every worker and then runs it too: `execute_model` (the `SchedulerOutput`) and
`sample_tokens` (the grammar bits); the collectives inside the forward (all-reduce, all-gather) keep the ranks
in lock step. The all-gathered logits are bit-identical on
every rank, so every rank runs the sampler (and the trace kernel) on them and appends the same tokens to its
slots; only rank 0's outputs are used.

Failure handling: a worker that raises sends its traceback and exits; a worker that dies closes its sockets;
either way rank 0's pending collective fails (gloo) or times out (`REPLAYLLM_TP_TIMEOUT_S`, default 300 s),
and rank 0 raises RuntimeError naming the worker and shuts the group down. Workers ignore SIGINT (Ctrl-C
reaches the whole process group: rank 0 handles it and stops them), exit when rank 0's pipe closes, and are
joined/terminated by `shutdown()`, by a `weakref.finalize` when the engine is collected, and at exit.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import EngineConfig
from ..step_io import GrammarBitmask, SchedulerOutput
from .async_output import AsyncModelRunnerOutput
from .model_runner import ModelRunner
from .models.parallel import min_across_ranks, tensor_parallel
from .runner_interface import RunnerInterface

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


def tp_timeout_s() -> float:
    return float(os.environ.get("REPLAYLLM_TP_TIMEOUT_S", "300"))


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config as rank `rank` sees it: on CUDA its own device cuda:<base + rank>. (No re-validation:
    the pickled copy keeps the fields rank 0 resolved.)"""
    if config.torch_device.type == "cuda":
        index = (config.torch_device.index or 0) + rank
        config.torch_device = torch.device("cuda", index)
        config.device = str(config.torch_device)
        torch.cuda.set_device(config.torch_device)
    return config


def _init_process_group(config: EngineConfig, rank: int, port: int) -> None:
    backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
    kwargs = {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the lent GPUs need it off)
        kwargs["device_id"] = torch.device("cuda", config.torch_device.index or 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=config.tensor_parallel_size, timeout=timedelta(seconds=tp_timeout_s()),
                            **kwargs)


def _worker_main(rank: int, config: EngineConfig, port: int, conn) -> None:
    """Entry point of worker `rank` (spawned). Messages: ("execute_model", SchedulerOutput), ("sample_tokens",
    GrammarBitmask | None), ("free", [ids]),
    ("load_weights", [(name, tensor)]), ("sleep", level), ("wake_up", [tag]), ("shutdown", None). Replies:
    ("ready", None) once loaded; ("error", traceback) before exiting on a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns Ctrl-C and shuts us down
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: this worker's stacks on stderr
    ok = False
    try:
        config = _rank_config(config, rank)
        _init_process_group(config, rank, port)
        with tensor_parallel(rank, config.tensor_parallel_size):
            runner = ModelRunner(config)
        conn.send(("ready", None))
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                break
            if kind == "execute_model":
                runner.execute_model(payload)
            elif kind == "sample_tokens":
                runner.sample_tokens(payload).get()  # its host token mirrors updated, as rank 0's
            elif kind == "free":
                runner.free_requests(payload)
            elif kind == "load_weights":
                runner.load_weights(payload)
            elif kind == "sleep":
                runner.sleep(payload)
                min_across_ranks(1, config.torch_device)  # rank 0 returns once every rank has given memory back
            elif kind == "wake_up":
                runner.wake_up(payload)
                min_across_ranks(1, config.torch_device)
            elif kind == "shutdown":
                ok = True
                break
            else:
                raise RuntimeError(f"unknown message {kind!r}")
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        if dist.is_initialized() and ok:
            dist.destroy_process_group()
        conn.close()
    os._exit(0 if ok else 1)  # skip interpreter teardown: a failed group may hang in its destructors


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Workers:
    """The spawned processes and their pipes; `close()` is idempotent and safe from a finalizer."""

    def __init__(self, procs: list, conns: list):
        self.procs, self.conns = procs, conns

    def close(self, graceful: bool = True) -> None:
        """graceful: ask the workers to stop and wait for them (idle between steps). Otherwise (a failed or
        interrupted step: workers may be stuck in a collective rank 0 left) terminate them at once."""
        for conn in self.conns if graceful else []:
            try:
                conn.send(("shutdown", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (_JOIN_TIMEOUT_S if graceful else 0.0)
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        if dist.is_initialized():
            _destroy_process_group(None if graceful else _DESTROY_WAIT_S)


_DESTROY_WAIT_S = 5.0


def _destroy_process_group(wait_s: float | None) -> None:
    """Tear the group down; after an interrupted step rank 0 may have left a collective half-way, and gloo's
    teardown can then wait for peers that were just killed: wait at most wait_s for it (a daemon thread), then
    leave it to the exiting process (the next tensor-parallel engine in this process is then refused)."""
    if wait_s is None:
        dist.destroy_process_group()
        return
    thread = threading.Thread(target=dist.destroy_process_group, name="replayllm-tp-destroy", daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        logger.warning("the tensor-parallel process group did not tear down within %.0f s (interrupted step)",
                       wait_s)


class TensorParallelRunner(RunnerInterface):
    """The runner for tensor_parallel_size > 1: rank 0's ModelRunner (`self.runner`) plus the worker processes;
    `execute_model` / `sample_tokens` / `free_requests` run on every rank."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (another "
                               "tensor-parallel engine is alive?): shut it down first (LLMEngine.shutdown())")
        self.config = config
        self.size = config.tensor_parallel_size
        self._failed: str | None = None
        port = _free_port()
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        for rank in range(1, self.size):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(rank, config, port, child_conn), daemon=True,
                            name=f"replayllm-tp{rank}")
            p.start()
            child_conn.close()
            procs.append(p)
            conns.append(parent_conn)
        self._workers = _Workers(procs, conns)
        self._finalizer = weakref.finalize(self, self._workers.close)
        try:
            _init_process_group(config, 0, port)
            with tensor_parallel(0, self.size):
                self.runner = ModelRunner(config)
            self.num_blocks = self.runner.num_blocks  # the minimum over ranks (kv_cache.determine_num_blocks)
            self._wait_ready()
        except BaseException as e:
            detail = self._worker_errors(wait_s=2.0)
            self._failed = f"start-up failed: {detail or e!r}"
            self.shutdown()
            if isinstance(e, KeyboardInterrupt):
                raise
            raise RuntimeError(f"tensor-parallel start-up failed: {detail or e}") from e

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shard of the model."""
        return self.runner.model

    # -- steps ------------------------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> None:
        with self._guard():
            self._broadcast("execute_model", sched)
            self.runner.execute_model(sched)

    def sample_tokens(self, grammar: GrammarBitmask | None) -> AsyncModelRunnerOutput:
        """Every rank samples its (identical, all-gathered) logits with the same bits and appends the same
        tokens; rank 0's results are waited for here and returned completed (steps are not overlapped across
        ranks yet: EngineConfig rejects async_scheduling with tensor_parallel_size > 1)."""
        with self._guard():
            self._broadcast("sample_tokens", grammar)
            return AsyncModelRunnerOutput.completed(self.runner.sample_tokens(grammar).get())

    def free_requests(self, request_ids: list[str]) -> None:
        with self._guard():
            if request_ids:
                self._broadcast("free", request_ids)
            self.runner.free_requests(request_ids)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Rank 0 checks and applies first (a bad tensor raises here, before any worker sees the update); then
        every worker gets the full tensors (on the CPU, pickled down its pipe) and takes its own slice."""
        if self._failed is not None:
            raise RuntimeError(f"the tensor-parallel group has failed earlier: {self._failed}")
        applied = self.runner.load_weights(weights)  # outside the guard: a ValueError leaves the group as is
        with self._guard():
            self._broadcast("load_weights", [(name, t.detach().cpu()) for name, t in weights])
        return applied

    def read_routed_experts(self, block_ids: list[int], num_positions: int) -> np.ndarray:
        """Rank 0's capture: every rank routes alike (the router is replicated and sees the reduced hidden
        states), so rank 0's buffer holds the routes of the whole group."""
        return self.runner.read_routed_experts(block_ids, num_positions)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)  # rank 0 first: sleep mode off is a ValueError before any worker is told
        with self._guard():
            self._broadcast("sleep", level)
            min_across_ranks(1, self.runner.device)

    def wake_up(self, tags: list[str]) -> None:
        self.runner.wake_up(tags)
        with self._guard():
            self._broadcast("wake_up", tags)
            min_across_ranks(1, self.runner.device)

    def shutdown(self) -> None:
        """Stop the workers (idempotent): gracefully, unless the group has failed."""
        if self._failed is not None and self._finalizer.alive:
            self._finalizer.detach()
            self._workers.close(graceful=False)
        self._finalizer()  # runs _Workers.close once
        if getattr(self, "runner", None) is not None:
            self.runner.shutdown()  # rank 0's own device memory

    # -- internals --------------------------------------------------------------------------------
    @contextmanager
    def _guard(self) -> Iterator[None]:
        """A step either runs on every rank or the group is shut down: Ctrl-C (rank 0 may be between two
        ranks' messages) stops the workers and re-raises; any other failure becomes one RuntimeError."""
        if self._failed is not None:
            raise RuntimeError(f"the tensor-parallel group has failed earlier: {self._failed}")
        try:
            yield
        except KeyboardInterrupt:
            self._failed = "interrupted (KeyboardInterrupt)"
            self.shutdown()
            raise
        except Exception as e:
            raise self._fail(e) from e

    def _broadcast(self, kind: str, payload) -> None:
        dead = [p for p in self._workers.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"worker process {dead[0].name} exited (exitcode {dead[0].exitcode})")
        for conn in self._workers.conns:
            conn.send((kind, payload))

    def _fail(self, cause: BaseException) -> RuntimeError:
        detail = self._worker_errors(wait_s=2.0)
        states = ", ".join(f"rank {i + 1} pid {p.pid} exitcode {p.exitcode}"
                           for i, p in enumerate(self._workers.procs))
        self._failed = f"{detail or cause} ({states})"
        self.shutdown()
        return RuntimeError(f"tensor-parallel worker failed: {self._failed}")

    def _worker_errors(self, wait_s: float) -> str:
        """Error tracebacks workers sent, waiting up to `wait_s` for them."""
        errors = []
        deadline = time.monotonic() + wait_s
        for rank, conn in enumerate(self._workers.conns, start=1):
            try:
                while conn.poll(max(0.0, deadline - time.monotonic())):
                    kind, payload = conn.recv()
                    if kind == "error":
                        errors.append(f"rank {rank}: {payload.strip().splitlines()[-1]}\n{payload}")
                        break
            except (EOFError, OSError):
                continue
        return "\n".join(errors)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + tp_timeout_s()
        for rank, (p, conn) in enumerate(zip(self._workers.procs, self._workers.conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive():
                    raise RuntimeError(f"worker rank {rank} exited during start-up (exitcode {p.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker rank {rank} not ready after {tp_timeout_s():.0f} s")
            kind, payload = conn.recv()
            if kind != "ready":
                raise RuntimeError(f"worker rank {rank}: {payload}")
