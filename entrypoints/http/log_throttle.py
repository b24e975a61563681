"""RepeatFilter: lets one of each kind of error log line through per time window and counts the rest."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

WINDOW_S = 10.0
MAX_KEYS = 1024  # distinct kinds remembered; past it, expired ones are dropped (all of them if none expired)
# Where the server's error lines come from: uvicorn's access log (4xx/5xx lines) and error log, ours.
THROTTLED_LOGGERS = ("uvicorn.access", "uvicorn.error", "replayllm.server", "replayllm.engine.async_engine")


def _kind(record: logging.LogRecord) -> str | None:
    """What makes two lines "the same": an access line's method, path and status (not the client's port);
    another warning or error's logger, format string and exception type. None: never throttled."""
    if record.name == "uvicorn.access":
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[4], int) and args[4] >= 400:
            return f"access {args[1]} {args[2]} {args[4]}"
        return None
    if record.levelno >= logging.WARNING:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        return f"{record.name} {record.msg} {exc}"
    return None


class RepeatFilter(logging.Filter):
    """The first line of a kind is logged; the same kind again within `window_s` is counted, not logged; the
    next one logged after the window says how many were left out."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, lines left out since)

    def filter(self, record: logging.LogRecord) -> bool:
        kind = _kind(record)
        if kind is None:
            return True
        now = self.clock()
        last, left_out = self._seen.get(kind, (None, 0))
        if last is not None and now - last < self.window_s:
            self._seen[kind] = (last, left_out + 1)
            return False
        if left_out:
            record.msg = f"{record.msg} [and {left_out} more like this in the {self.window_s:g}s before, not logged]"
        self._forget_old(now)
        self._seen[kind] = (now, 0)
        return True

    def _forget_old(self, now: float) -> None:
        if len(self._seen) < MAX_KEYS:
            return
        self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.window_s}
        if len(self._seen) >= MAX_KEYS:
            self._seen.clear()


def throttle_repeated_errors(window_s: float = WINDOW_S) -> RepeatFilter:
    """Install one RepeatFilter on the server's loggers (after uvicorn configured its own)."""
    f = RepeatFilter(window_s)
    for name in THROTTLED_LOGGERS:
        logging.getLogger(name).addFilter(f)
    return f
