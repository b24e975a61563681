"""GrammarWorkers: a structured step's per-row grammar work: bitmask rows filled over host threads, tokens accepted."""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# At most this many threads (the calling thread included): 256 rows inside JSON strings (~30-60 us each, xgrammar's
# slow path) are ~0.5-1 ms on 16; more threads add dispatch cost for less than that.
MAX_THREADS = 16
# Rows per claimed chunk, at least: a claim costs a few microseconds of Python (under the GIL), a row 3-60 us.
MIN_CHUNK_ROWS = 8


def _cgroup_cpu_limit() -> int | None:
    """A container's CPU quota in whole cores (cgroup v2 cpu.max, else v1's cfs quota), None when unlimited or
    unknown: a container may see every core of its host in its affinity mask yet be throttled to a few."""
    v2 = _read("/sys/fs/cgroup/cpu.max")  # "max 100000" or "<quota> <period>" (microseconds)
    if v2 is not None:
        quota, _, period = v2.strip().partition(" ")
    else:
        quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
        if quota is None or period is None:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max" (v2) or a malformed file
        return None
    return None if quota_us <= 0 or period_us <= 0 else max(1, -(-quota_us // period_us))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = _cgroup_cpu_limit()
    return cores if limit is None else min(cores, limit)


def default_num_threads() -> int:
    """Threads for a step's grammar work, the calling thread included: the usable cores less two (the engine
    loop's other work and the OS), 1 to MAX_THREADS. 1 (everything inline, no pool) on the 2-core CI machines;
    14 on a 16-core host."""
    return max(1, min(MAX_THREADS, usable_cores() - 2))


def _xgrammar():
    import xgrammar  # the manager checked it is installed before any grammar exists

    return xgrammar


def matcher_handles(matchers: list) -> list:
    """xgrammar's C++ matcher objects (`GrammarMatcher._handle`) of these matchers: what GrammarWorkers takes.
    The engine keeps each request's handle (RequestGrammar.handle), so a step builds no such list."""
    return [m._handle for m in matchers]


def _batch_core(batch):
    """The C++ side of an xgrammar BatchGrammarMatcher: its batch calls take matcher handles, whereas the Python
    wrapper converts a matcher list on every call under the GIL (~0.4 us a row, on the engine thread for the
    accept and, for the fill, on the fill thread while the engine thread waits for the GIL)."""
    core = getattr(batch, "_handle", None)
    if core is None or not hasattr(core, "batch_fill_next_token_bitmask"):  # pragma: no cover - xgrammar 0.2.x
        raise RuntimeError("this xgrammar has no BatchGrammarMatcher._handle; replayllm needs xgrammar 0.2")
    return core


@dataclass
class GrammarHostStats:
    """Host time in the grammar calls since the engine started (benchmarks divide by steps)."""

    accept_calls: int = 0
    accept_rows: int = 0
    accept_seconds: float = 0.0
    fill_calls: int = 0
    fill_rows: int = 0
    fill_seconds: float = 0.0  # the fills' own time (on the fill thread for start_fill)
    fill_wait_seconds: float = 0.0  # start_fill: the engine thread blocked on a fill that had not finished


class PendingFill:
    """A fill running on the GrammarWorkers' fill thread; `wait` blocks until the bits are written (re-raising
    the fill's error). Until then the matchers and the bitmask belong to the fill thread."""

    def __init__(self, handles: list, bitmask: np.ndarray, stats: GrammarHostStats):
        self.handles, self.bitmask, self._stats = handles, bitmask, stats
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds = 0.0

    def wait(self) -> None:
        start = time.perf_counter()
        self.done.wait()
        s = self._stats
        s.fill_wait_seconds += time.perf_counter() - start
        s.fill_calls, s.fill_rows = s.fill_calls + 1, s.fill_rows + len(self.handles)
        s.fill_seconds += self.seconds
        if self.error is not None:
            raise self.error


class GrammarWorkers:
    """A step's G bitmask rows are cut into contiguous chunks (>= MIN_CHUNK_ROWS rows, ~4 per thread so uneven
    rows balance); the calling thread and num_threads - 1 pool threads each claim chunks until none is left
    (accepting tokens stays on the calling thread: see `accept`). xgrammar releases the GIL inside the batch
    fill (not inside the batch accept), so the chunks really run in parallel. Rows never share a matcher, so the
    chunks touch disjoint state; a step's calls return only when every chunk is done. Async scheduling fills
    through `start_fill` instead: one call on a fill thread, beside the engine thread's other work."""

    def __init__(self, num_threads: int, fill_thread_pool_size: int | None = None):
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"grammar worker threads must be an int >= 1, got {num_threads!r}")
        self.num_threads = num_threads
        # xgrammar threads of `start_fill` (default: a quarter of the usable cores, 4 on the H200's 16): the engine
        # thread keeps running Python beside them. W1-json on the H200 host: 4 threads 0.80x plain W1, 14 threads
        # 0.68x, 8 0.52x in one call (busy fill threads beside it slow the engine thread; 4 fill 256 rows in
        # ~1.6 ms, hidden behind the previous step's output processing).
        if fill_thread_pool_size is not None and (not isinstance(fill_thread_pool_size, int)
                                                  or fill_thread_pool_size < 1):
            raise ValueError(f"fill thread pool size must be an int >= 1, got {fill_thread_pool_size!r}")
        self.fill_thread_pool_size = fill_thread_pool_size or max(1, min(num_threads, usable_cores() // 4))
        self.stats = GrammarHostStats()
        self._pool: ThreadPoolExecutor | None = None  # created at the first step big enough to split
        self._local = threading.local()  # one xgrammar BatchGrammarMatcher per thread (max_threads=1: no pool)
        self._accept = None
        self._jobs: queue.SimpleQueue | None = None  # start_fill's thread (started on first use)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        if self.num_threads == 1 or n < 2 * MIN_CHUNK_ROWS:
            return [(0, n)]
        size = max(MIN_CHUNK_ROWS, -(-n // (4 * self.num_threads)))
        return [(lo, min(n, lo + size)) for lo in range(0, n, size)]

    def _run(self, work, n: int) -> None:
        """work(lo, hi) for each chunk of range(n), on the caller and the pool; re-raises a chunk's error."""
        chunks = self._chunks(n)
        if len(chunks) == 1:
            work(0, n)
            return
        claims = itertools.count()  # next() on a count is atomic under the GIL: each chunk is claimed once

        def drain() -> None:
            while (i := next(claims)) < len(chunks):
                work(*chunks[i])

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="grammar")
        helpers = [self._pool.submit(drain) for _ in range(min(self.num_threads, len(chunks)) - 1)]
        try:
            drain()
        finally:
            for f in helpers:
                f.exception()  # wait for every helper: none may still touch the matchers once this returns
        for f in helpers:
            f.result()  # a helper's error, re-raised

    def accept(self, handles: list, tokens: list[int]) -> list[int]:
        """Matcher handles[i] (`matcher_handles`) accepts tokens[i] for every i; returns the i whose token was
        rejected (the matcher is then unchanged; never expected: each token was drawn under its bitmask)."""
        start = time.perf_counter()
        if self._accept is None:
            self._accept = _batch_core(_xgrammar().BatchGrammarMatcher(max_threads=1)).batch_accept_token
        # One call on the calling thread: accepting is cheap per row (~4 us) and on the H200 host 14 threads made
        # it slower (256 rows: 0.99 ms on one thread, 2.36 ms split over 14, bench/grammar_host_cost.py), the
        # dispatch costing more than the work. Only the fill (~15-60 us a row) is split.
        result = self._accept(handles, tokens, False)
        # `0 in result`: a C-level scan (~2 us for 256 rows); the common all-accepted case builds nothing.
        rejected = [i for i, ok in enumerate(result) if not ok] if 0 in result else []
        s = self.stats
        s.accept_calls, s.accept_rows = s.accept_calls + 1, s.accept_rows + len(handles)
        s.accept_seconds += time.perf_counter() - start
        return rejected

    def fill(self, handles: list, bitmask: np.ndarray) -> None:
        """bitmask[i] ([G, ceil(V/32)] int32, C-contiguous) = the tokens matcher handles[i] allows next; every
        word of each row is written (no clearing needed)."""
        start = time.perf_counter()

        def work(lo: int, hi: int) -> None:
            batch = getattr(self._local, "batch", None)
            if batch is None:
                batch = self._local.batch = _batch_core(_xgrammar().BatchGrammarMatcher(max_threads=1))
            batch.batch_fill_next_token_bitmask(handles[lo:hi], bitmask[lo:hi], None, False)  # rows lo..hi-1

        self._run(work, len(handles))
        s = self.stats
        s.fill_calls, s.fill_rows = s.fill_calls + 1, s.fill_rows + len(handles)
        s.fill_seconds += time.perf_counter() - start

    def start_fill(self, handles: list, bitmask: np.ndarray) -> PendingFill:
        """`fill`, on a thread of its own so the engine thread can do other Python work meanwhile (async scheduling:
        the previous step's outputs), `PendingFill.wait()` for the bits. One xgrammar call with xgrammar's own
        pool of fill_thread_pool_size C++ threads: it holds no GIL from start to end, whereas `fill`'s chunks each
        need the GIL to start, which the busy engine thread hands over only every sys.getswitchinterval() (5 ms).
        Returns once the fill thread has begun (a GIL hand-over of microseconds), so it cannot queue behind the
        engine thread's Python."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._fill_loop, args=(self._jobs,), name="grammar-fill", daemon=True).start()
        job = PendingFill(handles, bitmask, self.stats)
        self._jobs.put(job)
        job.started.wait()
        return job

    def _fill_loop(self, jobs: queue.SimpleQueue) -> None:
        try:
            batch = _batch_core(_xgrammar().BatchGrammarMatcher(max_threads=self.fill_thread_pool_size))
            broken = None
        except Exception as e:  # every job then fails with it: the engine thread must never wait on a dead thread
            batch, broken = None, e
        while (job := jobs.get()) is not None:
            job.started.set()
            try:
                if broken is not None:
                    raise RuntimeError(f"the grammar fill thread could not start: {broken}") from broken
                start = time.perf_counter()
                batch.batch_fill_next_token_bitmask(job.handles, job.bitmask, None, False)  # without the GIL
                job.seconds = time.perf_counter() - start
            except BaseException as e:  # handed to the engine thread by wait()
                job.error = e
            job.done.set()

    def shutdown(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
