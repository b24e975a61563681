"""TokenizerPool: tokenization, chat templating and big-body parsing off the event loop, bounded, two lanes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class ServerBusyError(RuntimeError):
    """The tokenizer pool's queue of large jobs is full: the server answers 503 (retry later)."""


class PoolClosedError(RuntimeError):
    """The pool was shut down (the server is stopping) before this job ran: the server answers 503."""


def default_pool_size() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class TokenizerPoolConfig:
    """`replayllm serve --tokenizer-pool-size / --tokenizer-pool-queue / --tokenizer-small-input-chars`."""

    size: int = field(default_factory=default_pool_size)  # worker threads of each lane
    max_queued: int = 32  # large jobs waiting or running at once; one more is ServerBusyError (503)
    small_input_chars: int = 65536  # a job smaller than this (characters / bytes) runs in the small lane

    def __post_init__(self):
        for name in ("size", "max_queued", "small_input_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tokenizer pool {name} must be an integer >= 1, got {value!r}")


class TokenizerPool:
    """Two thread pools of `size` workers: a *small* lane for jobs under `small_input_chars` and a *large* lane,
    so a small request never queues behind a big one. The large lane holds at most `max_queued` jobs (waiting
    or running); past that `run` raises ServerBusyError at once instead of queueing without bound (the small
    lane needs no bound of its own: each HTTP request has at most one job here, and `--limit-concurrency`
    bounds those).

    Threads, not processes: the slow part, encoding (~1 s per MB of text), runs in HF `tokenizers`'
    `encode_batch`, which releases the GIL (engine/tokenizer.py calls it directly); Python work (Jinja chat
    templates, id checks) yields the GIL every `sys.getswitchinterval()`. What holds the GIL in one C call is
    kept short or moved out: a large body's lists are counted in a helper process before it is parsed
    (entrypoints/http/body_counts.py), a /tokenize answer is serialised in slices. No lower CPU priority for the
    large lane: a niced thread that holds the GIL (building a list of ids) is descheduled on a busy machine
    while the event loop waits for that GIL, a priority inversion that stalls streams for seconds (docs/serving.md).
    The workers share the one tokenizer: encoding and decoding only read it (nothing here sets truncation or
    padding, which would change it)."""

    def __init__(self, config: TokenizerPoolConfig | None = None):
        self.config = config or TokenizerPoolConfig()
        # The pool is the parallelism: without this, `encode_batch` of many texts (20k bad words) runs on a
        # Rust thread per core and takes every core from the event loop and the engine core for its duration.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._small = _Lane("replayllm-tok", self.config.size)
        self._large = _Lane("replayllm-tok-large", self.config.size)
        self._large_jobs = 0  # waiting or running; changed on the event loop only

    def is_small(self, size: int) -> bool:
        return size < self.config.small_input_chars

    @property
    def large_jobs(self) -> int:
        return self._large_jobs

    async def run(self, fn: Callable[..., T], *args: Any, size: int) -> T:
        """fn(*args) on a worker of the lane `size` (the input's characters or bytes) picks, and its result.
        ServerBusyError when the large lane is full."""
        if self.is_small(size):
            return await self._small.run(fn, args)
        if self._large_jobs >= self.config.max_queued:
            raise ServerBusyError(f"the server is busy: {self._large_jobs} large inputs are being tokenized "
                                  f"(--tokenizer-pool-queue {self.config.max_queued}); retry later")
        self._large_jobs += 1
        try:
            return await self._large.run(fn, args)
        finally:
            self._large_jobs -= 1

    def shutdown(self) -> None:
        """Stop taking jobs; every job not finished fails with PoolClosedError at once (a running one's thread
        finishes on its own, its result dropped: it is a daemon thread, the process need not wait for it)."""
        self._small.shutdown()
        self._large.shutdown()


_STOP = object()


class _Lane:
    """`workers` daemon threads over one FIFO queue. Not a ThreadPoolExecutor: Python joins those at exit, so a
    server told to stop while a 20 MB prompt tokenizes would wait for it; a daemon thread does not hold the
    process (the shutdown rule: exit within 10 s however busy)."""

    def __init__(self, name: str, workers: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._running: set[concurrent.futures.Future] = set()  # jobs a worker is running (under _lock)
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(workers)]  # started by the first job (an app never served starts none)

    async def run(self, fn: Callable[..., T], args: tuple) -> T:
        if self._closed:
            raise PoolClosedError("the server is shutting down")
        if self._threads[0].ident is None:  # never started
            for t in self._threads:
                t.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        try:
            return await asyncio.wrap_future(future)
        finally:  # a job's error -> its traceback -> this frame -> the future -> the error: a cycle that kept
            del future  # the job's frames (a 5 MB prompt, its ids) alive until the next full GC

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            self._run_job(*job)
            del job  # an idle worker keeps nothing of its last job (a large request's input, until the next)

    def _run_job(self, fn: Callable, args: tuple, future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():  # cancelled while waiting (the caller went away)
            return
        with self._lock:
            self._running.add(future)
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        try:
            with self._lock:
                self._running.discard(future)
                if future.done():  # failed by shutdown() while it ran: its caller has answered already
                    return
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
        finally:  # error -> its traceback -> this frame -> error (and the future holding it): a cycle that kept
            del fn, args, future, result, error  # the job's frames (its prompt, its ids) until the next full GC

    def shutdown(self) -> None:
        self._closed = True
        while True:  # fail what has not started (an error, not a cancellation: its caller answers 503)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP and job[2].set_running_or_notify_cancel():
                job[2].set_exception(PoolClosedError("the server is shutting down"))
        with self._lock:  # running jobs fail now too: their callers answer at once, the threads finish alone
            for future in self._running:
                if not future.done():  # (a second shutdown finds them failed already)
                    future.set_exception(PoolClosedError("the server is shutting down"))
        for _ in self._threads:
            self._jobs.put(_STOP)
