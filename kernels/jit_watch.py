"""Late kernel variants: every Triton kernel variant a process meets for the first time after an engine's start-up.

Start-up (compile-ahead, graph capture, the warm-up: engine/warm_up.py) is there so that no Triton variant is
compiled inside a user's run: on a fresh machine each one is ~0.3-1 s of MLIR passes and ptxas in the middle of a
request (session 25 on the H200: an opt-in path's first S1 run took 4.17 s against 2.18 s for that reason). A
variant first met later is a gap in that coverage. `watch()` installs Triton's `jit_cache_hook` (called once per
new variant of the process, before it compiles or loads it from the on-disk cache), and every variant of this
package's kernels (not a colocated trainer's) met while no engine is starting (`starting()`) is logged as a
warning (its text holds LOG_MARK, which scripts count in a server's log) and counted (`late_variants()`):
`replayllm bench` reports the timed run's count (`late_kernel_variants`), so a benchmark that compiled inside its
measurement says so.
A hook installed before (a test's, bench/cold_start.py's) is still called, and its answer kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_PACKAGE = __name__.split(".")[0] + "."  # only this package's kernels are watched
LOG_MARK = "after start-up"  # in every late variant's warning (bench/api_cost.py and gpu_check.sh count it)
_LOCK = threading.Lock()
_STARTING = [0]  # engines being built in this process (their start-up's variants are expected)
_LATE: list[str] = []  # the late variants met so far: kernel name and Triton's description of the variant
_INSTALLED: list = []  # [the hook this module installed last]


@contextmanager
def starting() -> Iterator[None]:
    """An engine's start-up: the variants met inside are its compile-ahead's and warm-up's, not late."""
    with _LOCK:
        _STARTING[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STARTING[0] -= 1


def late_variants() -> list[str]:
    """Every late variant of this process so far, in order ("kernel: Triton's variant description")."""
    with _LOCK:
        return list(_LATE)


def on_new_variant(previous, **hook_args) -> bool | None:
    """The hook's body: note the variant unless an engine is starting (or Triton compiles it on purpose: a manual
    warm-up), then defer to the previous hook (True from it skips the compile, as Triton documents)."""
    fn = hook_args.get("fn")
    module = getattr(fn, "module", "")  # the kernel's module name (Triton's annotation says a module: either)
    ours = str(getattr(module, "__name__", module)).startswith(_PACKAGE)  # not a colocated trainer's kernels
    if ours and not hook_args.get("is_manual_warmup"):
        name = getattr(fn, "name", None) or str(fn)
        with _LOCK:
            late = _STARTING[0] == 0
            if late:
                _LATE.append(f"{name}: {str(hook_args.get('repr', ''))[:300]}")
        if late:
            logger.warning("Triton met a new variant of %s %s (a compile inside the run on an empty cache: the "
                           "start-up warm-up missed it): %s", name, LOG_MARK, str(hook_args.get("repr", ""))[:300])
    return previous(**hook_args) if previous is not None else False


def watch() -> bool:
    """Install the hook (True if it is in place), unless it already is; a hook set since (a test's) is wrapped in
    turn. A no-op without Triton's knobs (older Triton, or none)."""
    with _LOCK:
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        previous = runtime.jit_cache_hook
        if _INSTALLED and previous is _INSTALLED[0]:
            return True

        def hook(**hook_args):
            return on_new_variant(previous, **hook_args)

        runtime.jit_cache_hook = hook
        _INSTALLED[:] = [hook]
        return True
