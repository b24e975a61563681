"""`replayllm serve` starts its engine core process first thing (engine/early_core.py): the core imports while
the API process imports the server and builds the config. A server that gives up before the core gets its config
(a config that cannot be built, a taken port) must still fail cleanly, with the CLI's error and no process
left behind. (Every other server test starts its core this way.)"""

from __future__ import annotations

import os
import socket
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


def _serve_and_fail(model: str, tmp_path, *args: str) -> str:
    """Run `replayllm serve` expecting it to fail; its stderr, once no process it started is left."""
    mark = uuid.uuid4().hex
    env = dict(os.environ, REPLAYLLM_TEST_MARK=mark)
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", model, "--device", "cpu",
                          *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    deadline = time.monotonic() + 30
    while _processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(mark) == [], "a process the failed server started is still running"
    return out.stderr


def test_a_config_error_fails_cleanly_and_leaves_no_core(tiny_models, tmp_path):
    err = _serve_and_fail(tiny_models["qwen3"], tmp_path, "--max-model-len", "100000", "--port", "0")
    assert "max_model_len=100000 exceeds" in err, err[-2000:]


def test_a_taken_port_fails_cleanly_and_leaves_no_core(tiny_models, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _serve_and_fail(tiny_models["qwen3"], tmp_path, "--host", "127.0.0.1", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err, err[-2000:]


def test_a_bad_flag_fails_cleanly_and_leaves_no_core(tiny_models, tmp_path):
    """main() spawns the core before parsing the flags (parsing imports torch): a flag argparse refuses must
    stop it too."""
    err = _serve_and_fail(tiny_models["qwen3"], tmp_path, "--max-model-lenn", "64")
    assert "--max-model-lenn" in err, err[-2000:]


def test_main_spawns_the_core_before_parsing_serve_only(monkeypatch):
    import replayllm.entrypoints.cli.main as cli_main

    spawned = []

    class Fake:
        def __init__(self):
            spawned.append(self)

    monkeypatch.setattr("replayllm.engine.early_core.EarlyCore", Fake)
    assert isinstance(cli_main._early_core(["serve", "m", "--port", "0"]), Fake)
    for argv in (["serve", "--help"], ["serve", "m", "-h"], ["generate", "m"], ["bench", "throughput"], []):
        assert cli_main._early_core(argv) is None, argv
    assert len(spawned) == 1


def test_cancel_stops_the_process_and_removes_its_folder():
    early = EarlyCore()
    assert early.proc.is_alive() and os.path.isdir(early.dir)
    early.cancel()
    assert not early.proc.is_alive()
    assert not os.path.exists(early.dir)


def test_the_core_builds_its_config_from_the_arguments_or_reports_why_not(tiny_models):
    """send_args: the core builds EngineConfig(model, **kwargs) itself (the API process builds its copy beside
    it); a build that fails is reported on the handshake pipe, as the engine's own errors are. The number of API
    server processes it serves (--api-server-count) comes with either payload."""
    import multiprocessing

    from replayllm.config import EngineConfig
    from replayllm.engine.core_messages import decode_ready
    from replayllm.engine.core_proc import _config_from_api

    def through_pipes(payload):
        ready_recv, ready_send = multiprocessing.Pipe(duplex=False)
        config_recv, config_send = multiprocessing.Pipe(duplex=False)
        config_send.send(payload)
        config_send.close()
        config, note, clients = _config_from_api(ready_send, config_recv)
        ready_send.close()
        try:
            return config, note, clients, decode_ready(ready_recv.recv_bytes())
        except EOFError:  # nothing was reported
            return config, note, clients, None

    kwargs = {"device": "cpu", "max_model_len": 64, "skip_tokenizer_init": True}
    config, note, clients, ready = through_pipes((tiny_models["qwen3"], kwargs, 1))
    assert config == EngineConfig(model=tiny_models["qwen3"], **kwargs) and ready is None and clients == 1
    assert "waiting for its arguments" in note
    built = EngineConfig(model=tiny_models["qwen3"], **kwargs)
    config, note, clients, ready = through_pipes((built, 3))
    assert config == built and "waiting for its config" in note and clients == 3
    config, note, clients, ready = through_pipes((tiny_models["qwen3"], {**kwargs, "max_model_len": 100000}, 1))
    assert config is None and "max_model_len=100000 exceeds" in ready.error
