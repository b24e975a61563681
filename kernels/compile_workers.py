"""CompileWorkers: compile-ahead's Triton compiles run in worker processes, so they run in parallel for real.

Triton spends most of a variant's compile (~0.3 s on the H200's host) in Python, its AST-to-TTIR code generator,
under the GIL: compile-ahead's thread pool (kernels/compile_ahead.py) ran them one after another, 28 variants in
~9 s of a served cold start (docs/benchmarks.md, session 21). Here each variant's compile is described as plain
data (`CompileJob`: the kernel's module and name, signature, constexprs, attributes, target, options) and compiled
by a process of a pool into the on-disk Triton cache the processes share; the compile-ahead thread that asked then
runs Triton's own compile, which finds the variant there. So the kernel a process launches is always the one its
own Triton compile returns; the workers only fill the cache. A variant that cannot be described (a kernel outside
an importable module, a Triton whose async-compile closure differs), sent or compiled in a worker compiles on the
thread as before.

The workers are forks of one compile server process (kernels/compile_server.py) that imported torch and Triton
once; `start()` launches it on a thread, so its imports overlap the caller's: the engine core process starts it
first thing, and compile-ahead at its first variant to compile (a process whose variants are all compiled
already starts none). Until the server is up, variants compile on the threads as before. `stop()` ends them
once start-up is done; later compiles happen in the process as always. REPLAYLLM_COMPILE_WORKERS=0 turns them
off, N sets how many (default: the cores, at most 16). Where processes cannot be started (a daemonic process,
such as a tensor-parallel worker) the threads compile as before.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

JOB_TIMEOUT_S = 300.0  # one variant's compile in a worker; past it the thread compiles it itself


@dataclass(frozen=True)
class CompileJob:
    """One Triton variant's compile as plain data (picklable): what `triton.compile` needs besides the kernel,
    which the worker imports by module and name."""

    module: str
    name: str
    signature: dict
    constexprs: dict
    attrs: dict
    target: Any  # triton GPUTarget
    options: dict
    env_vars: dict | None  # Triton's cache-invalidating environment, where this Triton passes it


def _jit_function(module: str, name: str):
    """The JITFunction a module exposes under `name` (through an autotuner's or heuristics' `.fn`), or None."""
    from triton.runtime.jit import JITFunction

    obj = getattr(sys.modules.get(module), name, None)
    for _ in range(4):
        if isinstance(obj, JITFunction) or obj is None:
            return obj
        obj = getattr(obj, "fn", None)
    return None


def job_of(compile_fn) -> CompileJob | None:
    """The CompileJob of the closure Triton's async compile mode submits (its `src`, `target`, `options`), or None
    where it cannot be described so that another process compiles the same kernel."""
    code, closure = getattr(compile_fn, "__code__", None), getattr(compile_fn, "__closure__", None)
    if code is None or not closure:
        return None
    cells: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, closure):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    src, target, options = cells.get("src"), cells.get("target"), cells.get("options")
    jit = getattr(src, "fn", None)
    module, name = getattr(jit, "module", None), getattr(getattr(jit, "fn", None), "__name__", None)
    if target is None or options is None or not module or module == "__main__" or not name:
        return None
    if _jit_function(module, name) is not jit:  # another process would import another kernel under that name
        return None
    opts = options.__dict__ if hasattr(options, "__dict__") else options
    constants = getattr(src, "constants", None)  # ASTSource keeps its constexprs keyed by argument path
    if not isinstance(constants, dict) or not isinstance(opts, dict):
        return None
    return CompileJob(module, name, dict(src.signature), dict(constants), dict(src.attrs or {}), target, dict(opts),
                      cells.get("env_vars"))


def compile_job(job: CompileJob) -> None:
    """In a worker: compile the variant into the on-disk Triton cache (the result object is not sent back)."""
    import triton
    from triton.compiler import ASTSource

    importlib.import_module(job.module)
    jit = _jit_function(job.module, job.name)
    if jit is None:
        raise RuntimeError(f"no Triton kernel {job.module}.{job.name} in the compile worker")
    src = ASTSource(jit, job.signature, job.constexprs, job.attrs)
    extra = {} if job.env_vars is None else {"_env_vars": job.env_vars}
    triton.compile(src, target=job.target, options=job.options, **extra)


class CompileWorkers:
    """The compile server (kernels/compile_server.py: a process that forks the workers) and the futures of the
    jobs sent to it; started on a thread (see the module docstring)."""

    def __init__(self, size: int):
        self.size = size
        self.jobs = 0  # variants compiled by a worker
        self._proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()  # _proc, _pending, _next_id
        self._write_lock = threading.Lock()  # the server's stdin
        self._pending: dict[int, Future] = {}
        self._next_id = 0
        self._stopped = False
        threading.Thread(target=self._serve, name="replayllm-compile-workers", daemon=True).start()

    def _serve(self) -> None:
        """Start the server, then hand each reply to its job's future until the server's stdout closes."""
        try:
            if self._stopped:
                raise RuntimeError("stopped before it started")
            proc = subprocess.Popen([sys.executable, "-m", "replayllm.kernels.compile_server"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            with self._lock:
                self._proc = proc
            if self._stopped:  # stop() may have run before _proc was set: nothing closed it
                raise RuntimeError("stopped while it started")
            pickle.dump((list(sys.path), self.size), proc.stdin)
            proc.stdin.flush()
            if pickle.load(proc.stdout) != (-1, None):
                raise RuntimeError("unexpected first message")
        except Exception as e:  # noqa: BLE001 (no workers: the threads compile, as before)
            if not self._stopped:
                logger.info("Triton compile workers not started (%s: %s); compiling on threads", type(e).__name__,
                            e)
            self._close()
            self._ready.set()
            return
        self._ready.set()
        if self._stopped:  # stopped while it started
            self._close()
        while True:
            try:
                job_id, error = pickle.load(proc.stdout)
            except Exception:  # noqa: BLE001 (EOF: stopped, or the server died)
                break
            with self._lock:
                future = self._pending.pop(job_id, None)
            if future is not None:
                future.set_result(error)
        self._close()

    def _close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_result("the compile server stopped")
        if proc is not None:
            if not self._ready.is_set():
                proc.kill()  # still starting (importing): nothing of it is needed
            try:
                proc.stdin.close()  # EOF: the server stops its workers and exits (~1 s: not waited for here)
            except OSError:
                pass
            threading.Thread(target=_reap, args=(proc,), name="replayllm-compile-reap", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait for the server to be up (or to have failed to start); True when it is up."""
        return self._ready.wait(timeout) and self._proc is not None

    def compile(self, job: CompileJob) -> bool:
        """Compile the variant in a worker; False where that failed, or the server is not up yet (the thread then
        compiles it itself, as it would without workers: never slower than that)."""
        if not self._ready.is_set():
            return False
        future: Future = Future()
        with self._lock:
            proc = self._proc
            if proc is None:
                return False
            job_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[job_id] = future
        try:
            message = pickle.dumps((job_id, job))
            with self._write_lock:  # not the futures' lock: the reader thread never waits on a blocked write
                proc.stdin.write(message)
                proc.stdin.flush()
        except Exception as e:  # noqa: BLE001 (not picklable, or the server is gone: the thread compiles it)
            with self._lock:
                self._pending.pop(job_id, None)
            logger.debug("compile worker: %s.%s not sent (%s: %s)", job.module, job.name, type(e).__name__, e)
            return False
        try:
            error = future.result(timeout=JOB_TIMEOUT_S)
        except TimeoutError:
            error = "timed out"
        if error is not None:  # the thread compiles it, and raises its own error if it fails
            logger.debug("compile worker: %s.%s not compiled there (%s)", job.module, job.name, error)
            return False
        self.jobs += 1
        return True

    def stop(self) -> None:
        """Close the server's stdin: it stops its workers and exits. Waits for nothing: a server still starting
        is closed by its thread once it is up."""
        self._stopped = True
        self._close()


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_WORKERS: CompileWorkers | None = None
_LOCK = threading.Lock()


def host_cores() -> int:
    """The cores this process may use, at most 16: compile threads and workers both (more buys nothing)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cores))


def worker_count() -> int:
    """REPLAYLLM_COMPILE_WORKERS, else `host_cores()`; below 2 = no workers."""
    env = os.environ.get("REPLAYLLM_COMPILE_WORKERS")
    if not env:
        return host_cores()
    try:
        return max(0, int(env))
    except ValueError:
        raise ValueError(f"REPLAYLLM_COMPILE_WORKERS must be an integer (0 = none), got {env!r}") from None


def start() -> CompileWorkers | None:
    """Start this process's workers if they are not running (returns at once); None where they are off (no
    NVIDIA driver, the Triton interpreter, REPLAYLLM_COMPILE_WORKERS < 2, a daemonic process)."""
    global _WORKERS
    with _LOCK:
        if _WORKERS is None and _wanted():
            _WORKERS = CompileWorkers(worker_count())
        return _WORKERS


def running() -> CompileWorkers | None:
    return _WORKERS


def stop() -> None:
    """End this process's workers (start-up is done); a later `start()` starts new ones."""
    global _WORKERS
    with _LOCK:
        workers, _WORKERS = _WORKERS, None
    if workers is not None:
        workers.stop()


def _wanted() -> bool:
    """Cheap checks only (the engine core calls `start()` before it imports torch): an NVIDIA driver present and
    devices visible, compiled kernels (not the interpreter), processes allowed (not a daemonic process)."""
    import multiprocessing

    if os.environ.get("TRITON_INTERPRET") == "1" or worker_count() < 2 or multiprocessing.current_process().daemon:
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    return nvidia_driver_present()


def nvidia_driver_present() -> bool:
    """An NVIDIA driver on this host (its control device or /proc entry): a check without importing torch."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
