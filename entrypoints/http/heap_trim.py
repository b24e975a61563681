"""HeapTrimmer: hands the heap that large requests freed back to the OS (glibc's malloc_trim), off the event loop.

Why: a 5 MB prompt is tokenized on the pool's threads (Rust, through malloc) and parsed and validated (Python);
once it is answered all of that is freed, but glibc keeps freed pages in its per-thread arenas for reuse, and
the API process's RSS grew 567 -> 2,418 MiB over 9 such prompts without ever shrinking. malloc_trim(0) returns
the free pages of every arena (measured: a 1 MB prompt's ~120 MiB back to below the process's first RSS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time

LARGE_BODY = 1 << 16  # bytes: a body this large (what the tokenizer pool parses off the loop) asks for a trim
MIN_INTERVAL = 1.0  # s between two trims (one costs 12-22 ms after a 1 MB prompt, GIL released, arenas locked)


def _malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS: nothing to call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """`request()` after a large request: a daemon thread (started on the first call) runs malloc_trim(0) soon
    after, at most once per MIN_INTERVAL; a request during a trim or the pause after it gets one more trim
    once the pause is over, so the last large request is always followed by a trim."""

    def __init__(self, min_interval: float = MIN_INTERVAL):
        self.min_interval = min_interval
        self.trims = 0  # done so far (tests wait on it)
        self._trim = _malloc_trim()
        self._wanted = threading.Event()
        self._idle = threading.Condition()  # guards _busy; notified after each trim
        self._busy = False  # a trim is running
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def request(self) -> None:
        if self._trim is None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="heap-trim", daemon=True)
                self._thread.start()
        self._wanted.set()

    def wait_idle(self, timeout: float) -> bool:
        """Until no trim is wanted or running (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._wanted.is_set() or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            with self._idle:
                self._busy = True
                self._wanted.clear()
            self._trim(0)
            with self._idle:
                self.trims += 1
                self._busy = False
                self._idle.notify_all()
            time.sleep(self.min_interval)


TRIMMER = HeapTrimmer()  # one per process: the heap is
