"""/metrics over several API server processes (`replayllm serve --api-server-count N`): prometheus_client's
multiprocess mode, as vLLM uses it. Each process's counters and histograms live in files of a shared folder
(PROMETHEUS_MULTIPROC_DIR) and every process's /metrics sums all of them, so a scrape reads the same totals
whichever process answers. prometheus_client reads the variable when it is first imported, so `enable` runs in
`replayllm serve` before anything imports it; the extra processes inherit the variable. The engine's gauges and
step counters come from the core's snapshot, the same in every process, and are not summed."""

from __future__ import annotations

import os
import shutil
import tempfile

ENV = "PROMETHEUS_MULTIPROC_DIR"


def enable(num_processes: int) -> str | None:
    """For N > 1 processes: a fresh folder in ENV, returned (remove it with `cleanup` when the server stops).
    None for one process, or when ENV is already set (the user's folder, used as it is)."""
    if num_processes <= 1 or os.environ.get(ENV):
        return None
    folder = tempfile.mkdtemp(prefix="replayllm-metrics-")
    os.environ[ENV] = folder
    return folder


def active() -> bool:
    return bool(os.environ.get(ENV))


def cleanup(folder: str | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        if os.environ.get(ENV) == folder:
            del os.environ[ENV]
