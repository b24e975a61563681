"""`replayllm serve` starts its engine core process before the EngineConfig is built (engine/early_core.py): the
core imports while the API process builds the config. A config that cannot be built must still fail cleanly,
with the CLI's error and no core process left behind. (Every other server test starts its core this way.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from helpers.server_utils import alive

from replayllm.engine.early_core import EarlyCore


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (ours: readable)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes() and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_config_error_fails_cleanly_and_leaves_no_core(tiny_models, tmp_path):
    marker = f"REPLAYLLM_TEST_MARK={uuid.uuid4().hex}"
    env = dict(os.environ, REPLAYLLM_TEST_MARK=marker.split("=", 1)[1])
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", tiny_models["qwen3"],
                          "--device", "cpu", "--max-model-len", "100000", "--port", "0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    assert "max_model_len=100000 exceeds" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    deadline = time.monotonic() + 30
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


def test_cancel_stops_the_process_and_removes_its_folder():
    early = EarlyCore()
    assert early.proc.is_alive() and os.path.isdir(early.dir)
    early.cancel()
    assert not early.proc.is_alive()
    assert not os.path.exists(early.dir)
