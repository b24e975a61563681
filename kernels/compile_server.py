"""The compile server: `python -m replayllm.kernels.compile_server`, the process behind kernels/compile_workers.py.

It imports torch and Triton once, then forks its compile workers (a fork of a process that has not touched CUDA
and runs no other thread; nothing is imported again, and the user's main module is never re-run, as spawned or
forkserver children of the engine's process would re-run it). Protocol, pickles on its stdin and stdout:
in: the parent's sys.path and the worker count, then (job id, CompileJob) per variant; out: (job id, error text
or None) per finished job, in the order they finish. EOF on stdin (the parent stopped the server, or died): the
server stops its workers and exits; it also dies with its parent (Linux PDEATHSIG), its workers with it."""

from __future__ import annotations

import pickle
import sys
import threading


def _die_with_parent() -> None:
    """SIGKILL: the server and its workers hold nothing to clean up (parent_death.py)."""
    import signal

    from ..parent_death import die_with_parent

    die_with_parent(signal.SIGKILL)


def _warm_up_worker() -> None:
    """A worker's first compile pays Triton's one-time set-up (~0.5 s: the backend, LLVM, ptxas' version); paid
    here, right after the fork, while the engine still imports or loads, not inside its first job."""
    _die_with_parent()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from . import compile_warm_kernel

        src = ASTSource(compile_warm_kernel.copy_kernel, {"src": "*fp32", "dst": "*fp32", "BLOCK": "constexpr"},
                        {(2,): 16}, {})
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={})
    except Exception:  # noqa: BLE001 (a warm-up only: the real jobs report their own errors)
        pass


def _import_kernels() -> None:
    """Every module of the kernels package (the compiled ones; no .pyc on some hosts): once here, not per worker."""
    import importlib
    import pkgutil

    package = importlib.import_module(__package__)  # replayllm.kernels
    for info in pkgutil.iter_modules(package.__path__):
        try:
            importlib.import_module(f"{__package__}.{info.name}")
        except Exception:  # noqa: BLE001 (a job for it imports it again and reports the error)
            pass


def main() -> None:
    _die_with_parent()
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        path, workers = pickle.load(inp)
    except EOFError:  # stopped before it was told anything
        return
    sys.path[:] = path  # the parent's: its kernels' modules import here as there
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch  # noqa: F401 (imported once, here: every worker is a fork of this process)
    import triton  # noqa: F401
    import triton.compiler  # noqa: F401

    from .compile_workers import compile_job

    _import_kernels()
    lock = threading.Lock()

    def reply(job_id: int, future) -> None:
        error = future.exception()
        with lock:
            pickle.dump((job_id, None if error is None else f"{type(error).__name__}: {error}"), out)
            out.flush()

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                             initializer=_warm_up_worker) as pool:
        pool.submit(int).result()  # every worker forked (a fork pool starts them all at its first job) and warm
        with lock:
            pickle.dump((-1, None), out)  # ready
            out.flush()
        while True:
            try:
                job_id, job = pickle.load(inp)
            except (EOFError, pickle.UnpicklingError):
                break
            pool.submit(compile_job, job).add_done_callback(lambda f, i=job_id: reply(i, f))
        pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    main()
