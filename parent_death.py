"""Ground floor: `die_with_parent`, Linux's PR_SET_PDEATHSIG for the processes replayllm starts (the engine core,
extra API server processes, the Triton compile server and its workers): no orphan outlives a crashed parent.

Imports no folder of the package. Note the kernel's rule: the signal fires when the *thread* that started this
process exits, so start long-lived children from a thread that lives as long as they should."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (SIGTERM: its handlers run; SIGKILL: a
    process with nothing to clean up). A no-op where prctl is missing (not Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass
