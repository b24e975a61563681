"""CoreWatch: how an API server process notices that the engine core process has exited (EngineStartupError: it
failed to start); CoreAttachment: how an extra API server process (--api-server-count) reaches a core another
process started."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from dataclasses import dataclass


class EngineStartupError(RuntimeError):
    """The engine core process could not build its engine (bad weights, out of memory, ...) or died starting."""


@dataclass
class CoreAttachment:
    """The first API server process's core endpoints (`core_proc.client_paths` derives this process's from them),
    the core's pid and its start-up snapshot (EngineSnapshot fields), and this process's index, 1 .. N-1."""

    input_path: str
    output_path: str
    core_pid: int
    snapshot: tuple[int, ...]
    client: int


class CoreWatch:
    """The core as the process that started it sees it (`proc`: its sentinel, exit code, is_alive), or as an
    extra API server process does (`pid` only: a pidfd, readable once the core exits; where pidfd_open is
    missing there is no descriptor, and the first process, which does see the exit, stops this one)."""

    def __init__(self, proc: multiprocessing.process.BaseProcess | None = None, pid: int | None = None):
        if (proc is None) == (pid is None):
            raise ValueError("CoreWatch needs the core's process object or its pid, not both")
        self.proc = proc
        self.pid = proc.pid if proc is not None else pid
        self._fd: int | None = None

    def sentinel(self) -> int | None:
        """A descriptor that becomes readable when the core exits (for the event loop's add_reader)."""
        if self.proc is not None:
            return self.proc.sentinel
        if self._fd is None and hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(self.pid)
            except OSError:  # already gone (ESRCH), or no pidfd support in this kernel
                return None
        return self._fd

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.is_alive()
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, not ours to signal
            return True
        return True

    @property
    def exitcode(self) -> int | None:
        """The core's exit code (None: still running, or not this process's child)."""
        return self.proc.exitcode if self.proc is not None else None

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
