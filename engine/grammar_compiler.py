"""GrammarCompileService: xgrammar compiles in a killable child process, under a timeout, into a byte-bounded LRU."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection
from typing import NamedTuple

from .grammar_workers import usable_cores

WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammar_compile_worker.py")
POLL_S = 0.05  # how often a running compile is checked for its deadline and for a request still waiting on it
WORKER_START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) in a fresh interpreter: seconds, more when loaded
MiB = 1 << 20


class GrammarKey(NamedTuple):
    """What a compiled grammar depends on (with the tokenizer, fixed per engine): the cache's and dedup's key."""

    kind: str  # "json" | "json_object" | "regex" | "grammar" (choices arrive as EBNF)
    text: str  # the schema's JSON text, the regex or the EBNF ("" for json_object)
    any_whitespace: bool  # JSON only (False: disable_any_whitespace)


class GrammarCompileError(ValueError):
    """A request's grammar did not compile: too slow (timeout), rejected by xgrammar, or it crashed the worker.
    The message starts with `structured_outputs` (the HTTP 400's param)."""


class CompileCancelled(Exception):
    """No request waits for this grammar anymore (all aborted): its compile was stopped or never started."""


class CompileJob:
    """One distinct grammar being compiled: `future` (-> xgrammar.CompiledGrammar) and how many requests still
    wait for it. When the last one leaves (`release`), a queued compile is skipped and a running one is killed."""

    def __init__(self, key: GrammarKey, future: Future | None = None):
        self.key = key
        self.future: Future = future if future is not None else Future()
        self.waiters = 0  # guarded by the service's lock
        self.closed = False  # finished or cancelled: no new request attaches to it (guarded likewise)
        self._service: GrammarCompileService | None = None

    def release(self) -> None:
        """A request that waited for this grammar is gone (finished or aborted). Idempotence is the caller's."""
        if self._service is not None:
            self._service._release(self)


class CompiledGrammarCache:
    """Compiled grammars by GrammarKey, least recently used first; the sum of their xgrammar `memory_size_bytes`
    stays <= capacity_bytes (a grammar larger than that alone is not kept). Matchers keep the grammars they were
    made from alive, so an evicted grammar's memory goes when its last request does."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[GrammarKey, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: GrammarKey):
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: GrammarKey, compiled, nbytes: int) -> bool:
        """Keep `compiled` (nbytes), evicting the least recently used beyond the cap; False if it alone is over."""
        if nbytes > self.capacity_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.size_bytes -= old[1]
        self._entries[key] = (compiled, nbytes)
        self.size_bytes += nbytes
        while self.size_bytes > self.capacity_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.size_bytes -= evicted
        return True


class _Worker:
    """The child process (grammar_compile_worker.py) and our end of its socket."""

    def __init__(self, threads: int):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, WORKER_PATH, str(theirs.fileno()), str(threads)],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False

    def wait_ready(self, info_json: str, deadline: float, abandoned) -> None:
        """Hand the child the TokenizerInfo (the send returns once it has imported xgrammar and reads it) and
        wait for its compiler."""
        self.conn.send(info_json)
        while not self.conn.poll(POLL_S):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the grammar compile worker exited while starting (code {self.proc.returncode})")
            if abandoned():
                raise CompileCancelled()
            if time.monotonic() > deadline:
                raise RuntimeError("the grammar compile worker did not start in time")
        status, _ = self.conn.recv()
        if status != "ready":
            raise RuntimeError(f"the grammar compile worker answered {status!r} instead of ready")
        self.ready = True

    def kill(self) -> None:
        try:
            self.proc.kill()  # SIGKILL: xgrammar's compile cannot be stopped any other way
        except OSError:
            pass
        self.proc.wait()
        self.conn.close()


def default_compile_threads() -> int:
    """xgrammar threads of one compile: a quarter of the usable cores, 1 to 8 (1 on the 2-core CI machines, 4 on
    the H200's 16-core host): the engine loop and the grammar fill keep the rest."""
    return max(1, min(8, usable_cores() // 4))


class GrammarCompileService:
    """Compiles grammars one at a time, in order, on a child process fed by one thread ("grammar-compile").
    `submit` answers a cached grammar at once and joins requests asking for the same grammar into one job. A
    compile that runs past `timeout_s` (counted from the worker starting it) or that no request waits for any
    longer is stopped by killing the worker; a fresh one is started at once for the next job (its start does
    not count against any job's timeout). The compiled grammar comes back serialized and is rebuilt here
    (xgrammar's deserialize releases the GIL, as its compile does)."""

    def __init__(self, make_tokenizer_info: Callable[[], object], timeout_s: float, cache_bytes: int,
                 threads: int | None = None):
        self._make_info = make_tokenizer_info  # called on the compile thread (~1.5 s for a 150k vocabulary)
        self.info = None  # xgrammar.TokenizerInfo, once built: compiled grammars are rebuilt against it
        self._info_json = ""
        self.timeout_s = timeout_s
        self.threads = default_compile_threads() if threads is None else threads
        self.cache = CompiledGrammarCache(cache_bytes)
        self.num_compiles = 0  # compiles that reached the worker (tests: cache hits and dedup compile nothing)
        self.num_killed = 0  # workers killed: timeouts and abandoned compiles
        self._lock = threading.Lock()
        self._inflight: dict[GrammarKey, CompileJob] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: _Worker | None = None
        self._running: CompileJob | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="grammar-compile", daemon=True)
        self._thread.start()

    def submit(self, key: GrammarKey) -> CompileJob:
        """A job for `key` that the caller now waits on (call its `release` when the request goes)."""
        with self._lock:
            compiled = self.cache.get(key)
            if compiled is not None:
                future: Future = Future()
                future.set_result(compiled)
                return CompileJob(key, future)  # no service: release is a no-op
            job = self._inflight.get(key)
            if job is None:
                job = self._inflight[key] = CompileJob(key)
                job._service = self
                self._jobs.put(job)
            job.waiters += 1
            return job

    def _release(self, job: CompileJob) -> None:
        with self._lock:
            job.waiters -= 1
            cancel = job.waiters <= 0 and not job.closed and job is not self._running
            if cancel:
                self._close(job)  # still queued: the loop skips it (a running one: the loop sees it abandoned)
        if cancel:
            job.future.set_exception(CompileCancelled())

    def _close(self, job: CompileJob) -> None:
        """Under the lock: no request attaches to `job` anymore (a later one for the key gets a new job)."""
        job.closed = True
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]

    def _abandoned(self, job: CompileJob) -> bool:
        with self._lock:
            if job.waiters > 0:
                return False
            self._close(job)
            return True

    def _loop(self) -> None:
        try:
            self._worker = _Worker(self.threads)  # imports xgrammar while the TokenizerInfo is built here
            self.info = self._make_info()
            self._info_json = self.info.serialize_json()
            broken = None
        except Exception as e:  # every job then fails with it (e.g. no tokenizer)
            broken = e
            if self._worker is not None:
                self._worker.kill()
                self._worker = None
        while (job := self._jobs.get()) is not None:
            if broken is not None:
                with self._lock:
                    self._close(job)
                if not job.future.done():
                    job.future.set_exception(broken)
                continue
            with self._lock:
                if job.closed:
                    continue
                self._running = job
            try:
                compiled = self._compile(job)
            except BaseException as e:  # every error reaches the requests waiting on the job
                with self._lock:
                    self._close(job)
                    self._running = None
                with contextlib.suppress(InvalidStateError):
                    job.future.set_exception(e)
                continue
            with self._lock:
                self.cache.put(job.key, compiled, compiled.memory_size_bytes)
                self._close(job)
                self._running = None
            with contextlib.suppress(InvalidStateError):  # shutdown() may have cancelled it meanwhile
                job.future.set_result(compiled)

    def _compile(self, job: CompileJob):
        import xgrammar

        worker = self._worker
        if worker is None:
            if self._stopped:
                raise CompileCancelled()
            worker = self._worker = _Worker(self.threads)
        try:
            if not worker.ready:
                worker.wait_ready(self._info_json, time.monotonic() + WORKER_START_TIMEOUT_S,
                                  lambda: self._abandoned(job))
            worker.conn.send(tuple(job.key))
            self.num_compiles += 1
            deadline = time.monotonic() + self.timeout_s
            while not worker.conn.poll(max(0.0, min(POLL_S, deadline - time.monotonic()))):
                if self._abandoned(job):
                    raise CompileCancelled()
                if time.monotonic() >= deadline:
                    raise GrammarCompileError(
                        f"structured_outputs: grammar compilation timed out after {self.timeout_s:g} s "
                        "(--structured-outputs-compile-timeout); simplify the constraint")
                if worker.proc.poll() is not None:
                    raise GrammarCompileError(f"structured_outputs: the grammar compile worker died (exit code "
                                              f"{worker.proc.returncode}) compiling this constraint")
            status, payload = worker.conn.recv()
        except (CompileCancelled, GrammarCompileError, RuntimeError, EOFError, OSError):
            self._replace_worker()
            raise
        if status != "ok":
            raise GrammarCompileError(f"structured_outputs: the constraint does not compile: {payload}")
        return xgrammar.CompiledGrammar.deserialize_json(payload, self.info)

    def _replace_worker(self) -> None:
        """Kill the worker (whatever it was doing) and start its successor now, for the next job."""
        if self._worker is not None:
            self._worker.kill()
            self.num_killed += 1
        self._worker = None if self._stopped else _Worker(self.threads)

    def shutdown(self) -> None:
        self._stopped = True
        self._jobs.put(None)
        with self._lock:
            pending = list(self._inflight.values())
            for job in pending:
                self._close(job)
        for job in pending:
            if not job.future.done():
                job.future.set_exception(CompileCancelled())
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.kill()
