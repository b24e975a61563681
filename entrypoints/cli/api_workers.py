"""ApiWorkers: `replayllm serve --api-server-count N`'s extra HTTP server processes (N - 1 of them).

One API server process tops out at ~28k streamed tokens a second on an H200 host (~35 µs of CPU a token: the
output routing, the chunk JSON, the socket writes; docs/benchmarks.md): about what the engine makes on S1's
shape, less than it makes on shorter prompts or longer streams. As vLLM does, N processes then share the one
listening socket (the kernel hands each new connection to one of them) and the one engine core: each has its
own tokenizer, output state and ZeroMQ socket pair to the core, whose commands carry the sender's index so that
outputs go back to it (engine/client_routes.py).

The first process (the one `replayllm serve` started) binds the port and starts the core; once the core is
ready it spawns the others with the socket, the built EngineConfig and where the core listens
(CoreAttachment). Each extra process dies with the first (PR_SET_PDEATHSIG); the first stops them when it
stops, and stops the server when one of them dies. /metrics sums every process's counters and histograms
(entrypoints/http/multiprocess_metrics.py); stored responses (the Responses API) live in the process that made
them.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

from ...config import EngineConfig
from ...engine.core_client import EngineCoreClient
from ...engine.core_watch import CoreAttachment
from ...engine.early_core import STOP_TIMEOUT_S

logger = logging.getLogger("replayllm.server")
_UNPICKLABLE = ("early_core", "func")  # Namespace attributes that stay in the first process


# An extra process's entry point: target(args, config, attach, sock) (server_main.run_api_worker).
WorkerTarget = Callable[[argparse.Namespace, EngineConfig, CoreAttachment, socket.socket], None]


class ApiWorkers:
    """The first process's handle on the extra ones: `start` after the core is ready, `stop` when serving ends
    (returns 1 if one had died on its own). `on_exit(reason)` is called (from a watcher thread) when one dies
    while they should be running."""

    def __init__(self, args: argparse.Namespace, client: EngineCoreClient, sock: socket.socket,
                 target: WorkerTarget):
        self.count = args.api_server_count - 1
        self._target = target
        self._args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _UNPICKLABLE})
        self._client, self._sock = client, sock
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._stopping = threading.Event()
        self._died = False
        self.on_exit: Callable[[str], None] | None = None

    def start(self) -> None:
        """Spawn them (set `on_exit` first); the first process goes on serving meanwhile."""
        if self.count == 0:
            return
        ctx = multiprocessing.get_context("spawn")
        client = self._client
        for index in range(1, self.count + 1):
            attach = CoreAttachment(client.input_path, client.output_path, client.core_pid, client.snapshot.fields(),
                                    index)
            proc = ctx.Process(target=self._target, name=f"replayllm-api-server-{index}", daemon=False,
                               args=(self._args, client.config, attach, self._sock))
            proc.start()
            self._procs.append(proc)
        logger.info("started %d more API server processes (%s) on the same port", self.count,
                    ", ".join(str(p.pid) for p in self._procs))
        threading.Thread(target=self._watch, name="replayllm-api-workers", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self._procs}
        while sentinels and not self._stopping.is_set():
            for ready in wait(list(sentinels), timeout=0.5):
                proc = sentinels.pop(ready)
                if self._stopping.is_set():
                    return
                self._died = True
                reason = f"API server process {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
                logger.error("%s: stopping the server", reason)
                if self.on_exit is not None:
                    self.on_exit(reason)
                return

    def terminate(self) -> None:
        """SIGTERM each (uvicorn drains its requests, as the first process does); no waiting."""
        self._stopping.set()
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()

    def stop(self) -> int:
        """`terminate`, then wait for each (SIGKILL what is left); idempotent. 1 if one had died on its own."""
        self.terminate()
        for proc in self._procs:
            proc.join(STOP_TIMEOUT_S * 4)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs.clear()
        return 1 if self._died else 0

