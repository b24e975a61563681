"""EngineCoreProc: the process that runs the EngineCore when serving; a busy loop between two ZeroMQ sockets."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import time
from concurrent.futures import Future
from typing import Any

from ..config import EngineConfig
from ..kernels import compile_workers, jit_watch
from ..parent_death import die_with_parent
from .client_routes import ClientRoutes
from .core_messages import ABORT, ADD, ENCODER, SHUTDOWN, UTILITY, CoreOutputs, CoreReady, decode_command
from .core_outputs import CoreOutputCollector
from .engine_admin import ADMIN_METHODS
from .engine_core import EngineCore
from .engine_stats import EngineSnapshot
from .input_processor import InputProcessor, load_tokenizer_into
from .llm_engine import LLMEngine
from .warm_up import warm_up

logger = logging.getLogger(__name__)
# Engine methods the API server may call by name (utility calls), e.g. from tests and admin routes.
UTILITY_METHODS = ("snapshot", "num_requests", *ADMIN_METHODS)
PARENT_CHECK_S = 1.0  # idle: how long one wait for a command lasts before the parent is checked again
# Set to a file path: the core process runs its loop under cProfile and, when it stops, writes the stats there
# (pstats format) and the top functions by own time beside it (PATH.txt). For finding where a served step's
# host time goes (bench/gpu_check.sh: CORE_PROFILE=1); the profiler slows Python-heavy code ~1.5-2x.
CORE_PROFILE_ENV = "REPLAYLLM_CORE_PROFILE"


class EngineCoreProc:
    """Drains commands (add / abort / utility / shutdown), steps while work is pending, and sends one
    CoreOutputs per loop turn that did anything; idle, it blocks on the input socket (no spinning).
    output_sockets: one per API server process (--api-server-count; commands carry their sender's index), each
    turn's message cut per process by ClientRoutes when there are several."""

    def __init__(self, engine: EngineCore, input_socket, output_sockets: list, parent_pid: int):
        self.engine = engine
        self.collector = CoreOutputCollector()  # the core's output sink: ids out; the API server makes text
        self.input, self.outputs = input_socket, output_sockets
        self.routes = ClientRoutes(len(output_sockets)) if len(output_sockets) > 1 else None
        self._utility_clients: list[int] = []  # this turn's utility results' askers (several API servers)
        self.parent_pid = parent_pid
        self.unscheduled: set[str] = set()  # parent ids not yet in any step (for their queue time)
        self._last_parent_check = time.monotonic()

    def run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        while True:
            busy = self.engine.has_unfinished_requests()
            msg = CoreOutputs()
            if not busy:  # idle: sleep in the kernel until a command comes (or it is time to check the parent)
                poller.poll(PARENT_CHECK_S * 1000)
            if self._parent_gone():
                logger.warning("the API server process is gone: the engine core exits")
                return
            received = False
            while True:
                try:
                    frame = self.input.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received = True
                if not self._command(decode_command(frame), msg):
                    return
            if self.engine.has_unfinished_requests():
                msg = self._step(msg)
            if not (received or msg.num_step_reqs or msg.req_ids or msg.failed or msg.rejected or msg.asleep
                    or msg.prompt_logprobs):
                continue  # nothing happened (e.g. an async-scheduling turn that only launched): nothing to say
            msg.snapshot = _snapshot_fields(self.engine)
            if self.routes is None:
                self.outputs[0].send(ENCODER.encode(msg), copy=False)
            else:
                for sock, part in zip(self.outputs, self.routes.split(msg, self._utility_clients)):
                    sock.send(ENCODER.encode(part), copy=False)
                self._utility_clients = []

    def _parent_gone(self) -> bool:
        now = time.monotonic()
        if now - self._last_parent_check < PARENT_CHECK_S:
            return False
        self._last_parent_check = now
        return os.getppid() != self.parent_pid

    def _command(self, command: tuple[str, Any, int], msg: CoreOutputs) -> bool:
        kind, payload, client = command
        routes = self.routes
        if kind == ADD:
            for parent_id, prepared in payload:
                if routes is not None:  # first: a refusal below goes back to the sender too
                    routes.add(parent_id, [], client)
                if self.engine.is_sleeping():  # put to sleep by another API server (or since this one's check)
                    msg.asleep.append(parent_id)
                    continue
                try:
                    self.engine.add_request(parent_id, prepared, self.collector)
                    self.unscheduled.add(parent_id)
                except Exception as e:  # checked by the API server already: a bug or a duplicate id
                    logger.exception("could not add request %s", parent_id)
                    msg.failed.append(parent_id)
                    msg.step_error = msg.step_error or f"could not add request: {type(e).__name__}: {e}"
                    continue
                if routes is not None:
                    routes.add(parent_id, self.collector.parents[parent_id].child_ids, client)
        elif kind == ABORT:
            for parent_id in payload:
                self.engine.abort_request(parent_id, self.collector)
                self.unscheduled.discard(parent_id)
                if routes is not None:
                    routes.forget(parent_id)
        elif kind == UTILITY:
            call_id, name, args = payload
            msg.utility.append(self._utility(call_id, name, args))
            if routes is not None:
                self._utility_clients.append(client)
        elif kind == SHUTDOWN:
            return False
        return True

    def _utility(self, call_id: int, name: str, args: list) -> tuple[int, bool, Any]:
        try:
            if name not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {name!r}")
            if name == "snapshot":
                return call_id, True, list(_snapshot_fields(self.engine))
            if name in ADMIN_METHODS:  # sleep, wake_up, is_sleeping, update_weights_from_disk, reset_prefix_cache
                return call_id, True, getattr(self.engine, name)(*args)
            return call_id, True, len(self.collector.parents)  # num_requests: requests the core holds
        except Exception as e:  # "ValueError: ..." is the caller's mistake (core_client.EngineCallError)
            return call_id, False, f"{type(e).__name__}: {e}"

    def _step(self, msg: CoreOutputs) -> CoreOutputs:
        started = time.monotonic()
        try:
            out = self.engine.step(self.collector)
        except Exception as e:
            logger.exception("engine step failed; failing the %d requests in flight", len(self.collector.parents))
            msg.step_error = f"engine step failed: {type(e).__name__}: {e}"
            msg.rejected.extend((parent_id, str(error)) for parent_id, error in self.engine.take_rejected())
            for parent_id in list(self.collector.parents):
                msg.failed.append(parent_id)
                try:
                    self.engine.abort_request(parent_id, self.collector)
                except Exception:  # a broken engine must not stop the others from being failed
                    logger.exception("could not abort request %s", parent_id)
            self.unscheduled.clear()
            return msg
        ended = time.monotonic()
        if out is not None:  # None: no step's results this turn
            out.utility, out.failed, out.step_error, out.asleep = msg.utility, msg.failed, msg.step_error, msg.asleep
            msg = out
        msg.step_started, msg.step_ended = started, ended
        for parent_id, error in self.engine.take_rejected():  # e.g. a grammar that did not compile: a 400
            msg.rejected.append((parent_id, str(error)))
            self.unscheduled.discard(parent_id)
        msg.num_step_reqs = self.engine.last_step_num_reqs
        msg.num_step_tokens = self.engine.last_step_num_new_tokens
        self._stamp_scheduled(msg, started)
        return msg

    def _stamp_scheduled(self, msg: CoreOutputs, started: float) -> None:
        """Parents this step scheduled for the first time (read from the scheduler: a request is scheduled once
        its prefix-cache lookup ran, num_cached_tokens >= 0)."""
        requests, parents = self.engine.scheduler.requests, self.collector.parents
        for parent_id in list(self.unscheduled):
            parent = parents.get(parent_id)
            if parent is None:
                self.unscheduled.discard(parent_id)
                continue
            if any(c is not None and c.num_cached_tokens >= 0 for c in map(requests.get, parent.child_ids)):
                msg.scheduled[parent_id] = started
                self.unscheduled.discard(parent_id)


def _snapshot_fields(engine: EngineCore) -> tuple[int, ...]:
    return EngineSnapshot.of(engine).fields()


def _terminate(signum, frame) -> None:
    raise SystemExit(0)  # unwinds through the loop's finally: the engine (and any TP workers) shut down


def _profiled(loop, path: str) -> None:
    """loop() under cProfile; its stats written however it ends (SIGTERM's SystemExit included)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        loop()
    finally:
        prof.disable()
        prof.dump_stats(path)
        with open(path + ".txt", "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(60)
        logger.info("engine core profile written to %s (top functions: %s.txt)", path, path)


def client_paths(input_path: str, output_path: str, client: int) -> tuple[str, str]:
    """The ZeroMQ endpoints of API server process `client` (--api-server-count): 0 keeps the given ones."""
    return (input_path, output_path) if client == 0 else (f"{input_path}-{client}", f"{output_path}-{client}")


def _config_from_api(ready_conn, config_conn) -> tuple[EngineConfig | None, str, int]:
    """The early core's config (engine/early_core.py): what comes down `config_conn` is `(config, num_clients)`,
    the API process's EngineConfig, or `(model, engine keyword arguments, num_clients)` to build the same config
    here, beside the API process building its own copy (the config's ~10 s on a fresh H200, transformers' import
    mostly, off the critical path); num_clients: the API server processes (--api-server-count). (None, "", 0)
    when nothing is coming (EOF) or the build fails (reported on `ready_conn`, as the engine's errors are; the API
    process, whose own build fails the same way, prints it)."""
    import transformers.models.auto.configuration_auto  # noqa: F401 (what building or unpickling a config needs)

    start = time.monotonic()
    try:
        data = config_conn.recv_bytes()
    except (EOFError, OSError):
        return None, "", 0
    finally:
        config_conn.close()
    waited = time.monotonic() - start
    start = time.monotonic()
    try:
        received = pickle.loads(data)  # what Connection.recv does, timed apart (it may import config classes)
        built = isinstance(received[0], EngineConfig)
        config = received[0] if built else EngineConfig(model=received[0], **received[1])
        num_clients = received[-1]
    except BaseException as e:
        try:
            ready_conn.send_bytes(ENCODER.encode(CoreReady(error=f"{type(e).__name__}: {e}")))
        except OSError:  # the API process gave up first (its own build failed): nothing to tell
            pass
        return None, "", 0
    what = "its config" if built else "its arguments"
    return config, (f" (imports done, then {waited:.1f} s waiting for {what}, {time.monotonic() - start:.1f} s "
                    "to have the config)"), num_clients


def run_engine_core(config: EngineConfig | None, input_path: str, output_path: str, parent_pid: int, ready_conn,
                    config_conn=None, num_clients: int = 1) -> None:
    """The core process's entry point (multiprocessing spawn target). Builds the engine, answers the
    handshake through `ready_conn` (CoreReady), then loops until told to stop or the parent goes away.
    config None: started early (engine/early_core.py), the config or the arguments to build it (and
    num_clients) come down `config_conn` (`_config_from_api`); the imports it needs are done while waiting; EOF
    there (the API process could not build it): exit. num_clients: API server processes, each with its own
    endpoints (`client_paths`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API server stops us
    die_with_parent()
    note = ""  # the early core's start-up timeline, logged once logging is set up
    if config is None:
        # Until its config comes, an early core only imports (EarlyCore.cancel terminates it then): SIGTERM keeps
        # its default action. A SystemExit raised inside the import machinery is "ignored" with a traceback on the
        # shared stderr, and the imports go on.
        config, note, num_clients = _config_from_api(ready_conn, config_conn)
        if config is None:
            return
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s (engine core): %(message)s")
    logger.info("building the engine for %s%s", config.model or "the embedded default model", note)
    import zmq

    ctx = zmq.Context(io_threads=1)
    inp, outs = ctx.socket(zmq.PULL), [ctx.socket(zmq.PUSH) for _ in range(num_clients)]
    for client, out in enumerate(outs):  # one PULL fair-queues the commands of every API server process
        client_in, client_out = client_paths(input_path, output_path, client)
        inp.connect(client_in)
        out.connect(client_out)
    engine = None
    tokenizer: Future | None = None if config.skip_tokenizer_init else Future()
    try:
        try:
            # Its tokenizer is for grammars only (the API process tokenizes and detokenizes): it loads once the core
            # is ready (below), the first grammar waits for it; the warm-up sends token ids and reads no text.
            with jit_watch.starting():  # as LLMEngine(config) does (engine/warm_up.py, kernels/jit_watch.py)
                engine = EngineCore(config, tokenizer)
                if config.torch_device.type == "cuda":
                    warm_up(LLMEngine.around(engine, InputProcessor(config, with_tokenizer=False)))
                    jit_watch.watch()
        except BaseException as e:  # reported to the API server, which prints it and exits non-zero
            ready_conn.send_bytes(ENCODER.encode(CoreReady(error=f"{type(e).__name__}: {e}")))
            return
        finally:
            compile_workers.stop()  # start-up's compiles are done (kernels/compile_workers.py)
        gc.collect()
        gc.freeze()  # the model's ~0.4M long-lived objects: out of every later collection
        ready_conn.send_bytes(ENCODER.encode(CoreReady(snapshot=_snapshot_fields(engine))))
        ready_conn.close()
        if tokenizer is not None:
            load_tokenizer_into(tokenizer, config)
        loop = EngineCoreProc(engine, inp, outs, parent_pid).run
        profile_path = os.environ.get(CORE_PROFILE_ENV)
        if profile_path:
            _profiled(loop, profile_path)
        else:
            loop()
    except SystemExit:
        pass
    finally:
        if engine is not None:
            engine.shutdown()
        inp.close(linger=0)
        for out in outs:
            out.close(linger=1000)
        ctx.term()
        sys.stdout.flush()
