"""EarlyCore: `replayllm serve`'s engine core process, started before its EngineConfig exists.

Both processes pay the same imports (torch, transformers, the engine) before the model can load, and building
the EngineConfig costs seconds more (transformers' AutoConfig and its imports: 9.7 s in the API process on a
fresh H200). Spawned with the config, the core could only start importing after all that. Spawned early (by
`replayllm serve` before it even parses its flags), it imports while this process does; then this process sends
it the config's arguments (`send_args`: model and engine keyword arguments) and builds its own copy while the
core builds the same config from them and goes on as `run_engine_core` always does (`send_config`, the built
config, is the other way in). A config that fails to build fails in both: the core reports it on the handshake
pipe and exits, this process prints its own error and cancels it (`cancel`: the pipes close, the process is
stopped, nothing was loaded).

This module imports nothing heavy (no torch, no config): `replayllm serve` starts the process before the API
process itself imports torch and the server, so the two import side by side; the child's target, `_run`,
imports the core there."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import EngineConfig

STOP_TIMEOUT_S = 4.0  # a clean core exit (after SHUTDOWN, or on cancel); then SIGTERM / SIGKILL


def _run(input_path: str, output_path: str, parent_pid: int, ready_conn, config_conn) -> None:
    """The spawned process's target: the engine core's imports happen here, then `run_engine_core` waits for
    its config."""
    from ..kernels import compile_workers

    compile_workers.start()  # their imports (torch, Triton) overlap this process's; kernels/compile_workers.py
    from .core_proc import run_engine_core

    run_engine_core(None, input_path, output_path, parent_pid, ready_conn, config_conn)


class EarlyCore:
    """The spawned process, its handshake pipe and the pipe its config goes down (see the module docstring)."""

    def __init__(self):
        self.spawned_at = time.monotonic()  # start-up timeline (server_main logs the config's time against it)
        ctx = multiprocessing.get_context("spawn")
        self.dir = tempfile.mkdtemp(prefix="replayllm-core-")
        self.input_path, self.output_path = f"ipc://{self.dir}/input", f"ipc://{self.dir}/output"
        self.ready_recv, ready_send = ctx.Pipe(duplex=False)
        config_recv, self._config_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_run, name="replayllm-engine-core", daemon=False,
                                args=(self.input_path, self.output_path, os.getpid(), ready_send, config_recv))
        self.proc.start()
        ready_send.close()
        config_recv.close()

    def send_args(self, model: str | None, engine_kwargs: dict, num_clients: int = 1) -> None:
        """Hand over what the config is built from, before this process builds its own copy: the core builds the
        same config (same arguments, environment and files) without waiting for ours, then its engine, and
        answers on `ready_recv`. num_clients: the API server processes it serves (--api-server-count)."""
        self._config_send.send((model, engine_kwargs, num_clients))
        self._config_send.close()

    def send_config(self, config: EngineConfig, num_clients: int = 1) -> None:
        """Hand the built config over (when `send_args` was not used); the core then builds its engine and
        answers on `ready_recv`."""
        self._config_send.send((config, num_clients))
        self._config_send.close()

    @property
    def sent(self) -> bool:
        """Its config, or the arguments to build it, went down the pipe (which then closed)."""
        return self._config_send.closed

    def cancel(self) -> None:
        """No config is coming: stop the process now (it has only imported modules: nothing to clean up; one
        already waiting on the pipe would also exit on its EOF) and remove its socket folder."""
        self._config_send.close()
        self.ready_recv.close()
        self.proc.terminate()
        self.proc.join(STOP_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        try:
            os.rmdir(self.dir)
        except OSError:
            pass
