"""Compile ahead: Triton variants compiled on a thread pool, not one after another at their first launch.

A fresh machine (empty Triton cache) compiles every kernel variant a process needs once, ~0.3-0.6 s each (the
MLIR passes, ptxas, the launcher's C build); CUDA-graph capture alone met 13 of them one by one on the 0.6B
shape (~7 s of a 10 s capture). Inside `compile_ahead()`, a Triton launch does not run: it submits its
variant's compile to the pool (Triton's AsyncCompileMode) and returns; leaving the block waits for them all.
So a caller runs the code whose launches it wants compiled (an eager forward of every graph size, say) inside
the block, then runs it for real: the variants are in the process's cache by then.

Inside the block nothing a Triton kernel would write is written: run only code whose results are thrown away,
and no code that reads a kernel's output on the host or depends on it for control flow. A compile that fails
in the pool fails again, with its own error, at the real launch. Without Triton's async compile mode (older
Triton), under the interpreter, or off CUDA, the block does nothing and the compiles happen at the real
launches, as before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from . import compile_workers

logger = logging.getLogger(__name__)


def _async_mode_class():
    """Triton's AsyncCompileMode, or None where this Triton lacks it (or runs the interpreter)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode


class _CompilePool(ThreadPoolExecutor):
    """Runs each compile (in a compile worker process first where it can: kernels/compile_workers.py; else all
    of it on this thread, its Python part under the GIL), then builds its launcher (the C module Triton otherwise
    builds with the host compiler at the variant's first launch, on the caller's thread); a launcher that fails
    to build here is built, or fails, at that launch as before."""

    def submit(self, fn, /, *args, **kwargs):
        workers = compile_workers.start()  # None where off; else already running (started early) or starting

        def compile_and_build():
            job = compile_workers.job_of(fn) if workers is not None and not args and not kwargs else None
            if job is not None:
                workers.compile(job)  # into the on-disk cache, in parallel; Triton's compile below then finds it
            kernel = fn(*args, **kwargs)
            try:
                from triton.runtime.driver import driver

                driver.active.launcher_cls(kernel.src, kernel.metadata)  # cached on disk by its source
            except Exception:  # noqa: BLE001 (best effort: the first launch builds it otherwise)
                pass
            return kernel

        return super().submit(compile_and_build)


def compile_ahead_workers() -> int:
    """Compile threads: the cores this process may use, at most 16 (REPLAYLLM_COMPILE_THREADS overrides;
    1 turns compile-ahead off)."""
    env = os.environ.get("REPLAYLLM_COMPILE_THREADS")
    return max(1, int(env)) if env else compile_workers.host_cores()


def _active() -> bool:
    from triton.runtime import _async_compile

    return _async_compile.active_mode.get() is not None


@contextmanager
def compile_ahead(device: torch.device, what: str) -> Iterator[None]:
    """Inside: Triton launches compile their variants on a thread pool instead of running (see the module
    docstring); on exit, every compile is done. `what` names the caller in the log line."""
    mode_class = _async_mode_class()
    workers = compile_ahead_workers()
    if device.type != "cuda" or mode_class is None or workers < 2 or _active():
        yield  # nothing to do, or an enclosing block already compiles ahead
        return
    from triton.runtime.jit import JITFunction

    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    start = time.perf_counter()
    with _CompilePool(max_workers=workers, thread_name_prefix="replayllm-compile") as pool:
        try:
            mode = mode_class(pool, ignore_errors=True)
        except TypeError:  # a Triton whose mode has no ignore_errors: a failed compile then raises here
            mode = mode_class(pool)
        JITFunction.run = compile_only
        try:
            with mode:
                yield
        finally:
            JITFunction.run = original_run
    compiled = len(mode.raw_futures)
    if compiled:
        logger.info("%s: %d Triton variants compiled ahead on %d threads in %.1f s", what, compiled, workers,
                    time.perf_counter() - start)
