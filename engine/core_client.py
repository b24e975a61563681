"""EngineCoreClient: the API server's side of the engine core process (start-up, commands, output routing)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..config import EngineConfig
from ..sampling_params import RequestOutputKind, SamplingParams
from .client_outputs import ClientOutputRouter
from .core_messages import ABORT, ADD, SHUTDOWN, UTILITY, decode_ready, encode_command
from .core_output_reader import CoreOutputReader
from .core_proc import client_paths, run_engine_core
from .core_watch import CoreAttachment, CoreWatch, EngineStartupError
from .early_core import STOP_TIMEOUT_S, EarlyCore
from .engine_admin import EngineAdmin
from .engine_stats import EngineSnapshot, StatsSink
from .input_processor import InputProcessor, checks_only
from .request_stream import EngineAsleepError, EngineDeadError, RequestAborted, RequestStream, Tracked
from .tokenizer_pool import TokenizerPool, TokenizerPoolConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineCallError(RuntimeError):
    """A utility call raised in the engine core: `type_name` is its exception's class name ("ValueError": the
    caller's mistake), `message` its text (the wire carries "TypeName: message")."""

    def __init__(self, text: str):
        super().__init__(text)
        type_name, sep, message = text.partition(": ")
        self.type_name, self.message = (type_name, message) if sep and type_name.isidentifier() else ("", text)


class EngineCoreClient(EngineAdmin):
    """The AsyncLLMEngine interface (run / add_requests / abort / snapshot / is_running, EngineAdmin) over an
    engine core process. This process keeps the tokenizer (InputProcessor: every request check runs here) and
    the output state (OutputProcessor: detokenization, stop strings, logprob objects); the core only schedules
    and runs the model. A core that dies fails every request in flight at once (EngineDeadError) and calls `on_dead`."""

    def __init__(self, config: EngineConfig, stats: StatsSink | None = None,
                 tokenizer_pool: TokenizerPoolConfig | None = None, early: EarlyCore | None = None,
                 num_clients: int = 1, attach: CoreAttachment | None = None):
        """num_clients: the API server processes the core will serve (--api-server-count; this one starts it).
        attach: this is one of the extra processes, reaching the core another one started (never stops it)."""
        self.config = config
        self.stats = stats or StatsSink()
        self.snapshot = EngineSnapshot() if attach is None else EngineSnapshot.from_fields(attach.snapshot)
        self._inputs: InputProcessor | None = None  # the tokenizer: built by start_core while the core loads
        self.on_dead: Callable[[str], None] | None = None  # called once with the reason when the core dies
        self._early = early  # a core process already started (engine/early_core.py): start_core hands it config
        self._attach = attach
        self.num_clients = num_clients
        self._client = 0 if attach is None else attach.client
        # This process's command and output endpoints (the first process's: what `client_paths` derives the
        # other processes' from).
        if attach is not None:
            self._dir = None
            self.input_path, self.output_path = client_paths(attach.input_path, attach.output_path, attach.client)
        else:
            self._dir = early.dir if early is not None else tempfile.mkdtemp(prefix="replayllm-core-")
            self.input_path = f"ipc://{self._dir}/input"
            self.output_path = f"ipc://{self._dir}/output"
        self._proc: multiprocessing.process.BaseProcess | None = None  # the core, when this process started it
        self._watch = CoreWatch(pid=attach.core_pid) if attach is not None else None  # set by start_core
        self.tokenizer_pool = TokenizerPool(tokenizer_pool)  # every tokenization: off the event loop
        self._router_state: ClientOutputRouter | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._input = self._reader = None
        self._zmq = self._out_zmq = None  # zmq.Contexts of the input and output sockets: one I/O thread each
        # The core's outputs, routed by the output state (self._router: a test may swap it in after this).
        self._outputs = CoreOutputReader(lambda msgs: self._router.apply_many(msgs), self._die)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._stopping = False
        # Sleep mode, mirrored here so that no request reaches a sleeping core (see sleep()); the admin calls
        # that change it run one at a time, so the mirror cannot be overwritten by an older answer.
        self._asleep = False
        self._admin_lock = asyncio.Lock()

    @property
    def inputs(self) -> InputProcessor:
        """Every request check and the tokenizer (this process's side). Built on first use: start_core builds
        it after spawning the core, so the tokenizer loads here while the model loads there."""
        if self._inputs is None:
            self._inputs = InputProcessor(self.config)
        return self._inputs

    @property
    def _router(self) -> ClientOutputRouter:
        """The output state of every request (built with `inputs`, on first use)."""
        if self._router_state is None:
            self._router_state = ClientOutputRouter(self.inputs, self)
        return self._router_state

    @_router.setter
    def _router(self, router: ClientOutputRouter) -> None:  # a test's stand-in router
        self._router_state = router

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start_core(self, poll_s: float = 0.5) -> None:
        """Spawn the core and wait until its engine is built (EngineStartupError if it fails or dies).
        Blocking, before the server's event loop runs: the model loads while the port is already bound."""
        if self._attach is not None:
            raise RuntimeError("an attached API server process does not start the engine core")
        self._bind_input()
        if self._early is not None:  # spawned before the config existed: it has been importing meanwhile
            self._proc, ready_recv = self._early.proc, self._early.ready_recv
        else:
            ctx = multiprocessing.get_context("spawn")
            ready_recv, ready_send = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=run_engine_core, name="replayllm-engine-core", daemon=False,
                                     args=(self.config, self.input_path, self.output_path, os.getpid(),
                                           ready_send, None, self.num_clients))
            self._proc.start()
            ready_send.close()
        try:
            if self._early is not None and not self._early.sent:  # not when it builds its own (send_args)
                logger.info("sending the engine config to the engine core process")  # start-up timeline
                try:
                    self._early.send_config(self.config, self.num_clients)
                except OSError:  # it died importing: the liveness poll below reports its exit code
                    pass
            _ = self._router  # the tokenizer and the output state, built while the core process loads the model
            while not ready_recv.poll(poll_s):  # liveness polling: a core that dies loading never hangs us
                if not self._proc.is_alive():
                    raise EngineStartupError(f"the engine core process exited with code {self._proc.exitcode} "
                                             "while loading the model (see the log above)")
            try:
                ready = decode_ready(ready_recv.recv_bytes())
            except EOFError as e:
                raise EngineStartupError("the engine core process closed its handshake pipe") from e
            if ready.error is not None:
                raise EngineStartupError(ready.error)
        except BaseException:  # includes Ctrl-C during the load: no orphan core left behind
            self._kill_core()
            raise
        finally:
            ready_recv.close()
        self._watch = CoreWatch(proc=self._proc)
        self.snapshot = EngineSnapshot.from_fields(ready.snapshot)
        logger.info("engine core process %d ready (%d KV blocks)", self._proc.pid, self.snapshot.num_kv_blocks)

    def _bind_input(self) -> None:
        import zmq

        self._zmq = zmq.Context(io_threads=1)
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.bind(self.input_path)

    def start(self) -> None:
        """Start routing outputs (on the server's event loop, from its lifespan)."""
        import zmq

        if self._attach is not None:
            self._bind_input()
        elif self._proc is None:
            self.start_core()
        self._loop = asyncio.get_running_loop()
        self._out_zmq = zmq.Context(io_threads=1)  # its own I/O thread (the input socket has self._zmq's)
        self._outputs.bind(self._out_zmq, self.output_path)
        self._running = True
        sentinel = self._watch.sentinel()
        if sentinel is not None:
            self._loop.add_reader(sentinel, self._core_exited)  # readable once the process is gone
        self._reader = self._loop.create_task(self._outputs.run(), name="replayllm-core-outputs")
        if not self._watch.alive():
            self._core_exited()

    async def shutdown(self) -> None:
        """Stop the core (SHUTDOWN, then SIGTERM, then SIGKILL) and fail whatever is still in flight."""
        self._stopping = True
        self._running = False
        self._stop_watching()
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._outputs.close()
        await asyncio.to_thread(self.close)

    def fail_in_flight(self, reason: str) -> None:
        """The server is stopping: fail every request in flight and every tokenization (their callers answer with
        an error JSON or an SSE error event) and refuse new ones; the core stops later (shutdown/close)."""
        self._running = False
        self.tokenizer_pool.shutdown()
        self._fail_all(EngineDeadError(reason))

    def close(self) -> None:
        """Stop the core process if it still runs and release the sockets (idempotent, blocking)."""
        self._stopping = True
        self._running = False
        if self._proc is not None and self._proc.is_alive():
            if self._input is not None:
                import zmq

                # Never blocks: a core that stopped first (SIGTERM to the whole process group, as `timeout` sends)
                # leaves the PUSH socket without a peer, where a blocking send waited forever; _kill_core bounds it.
                with contextlib.suppress(zmq.Again):
                    self._input.send(encode_command(SHUTDOWN, None, self._client), copy=False, flags=zmq.NOBLOCK)
            self._kill_core()
        if self._input is not None:
            self._input.close(linger=0)
        self._input = None
        self._outputs.close()
        for ctx in (self._zmq, self._out_zmq):  # sockets closed: term() returns at once and ends the I/O thread
            if ctx is not None:
                ctx.term()
        self._zmq = self._out_zmq = None
        self.tokenizer_pool.shutdown()
        if self._watch is not None:
            self._watch.close()
        for path in (self.input_path, self.output_path):  # this process's endpoints
            with contextlib.suppress(OSError):
                os.unlink(path.removeprefix("ipc://"))
        if self._dir is not None:  # the first process: the folder (empty once every process has left)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)

    def _kill_core(self) -> None:
        proc = self._proc
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def client_index(self) -> int:
        """This API server process's index (0: the one that started the core; --api-server-count)."""
        return self._client

    @property
    def core_pid(self) -> int | None:
        return None if self._watch is None else self._watch.pid

    # -- API (event loop) --------------------------------------------------------------------------------
    async def run_tokenizer(self, fn: Callable[[InputProcessor], T], *, size: int) -> T:
        """fn(input processor) on the tokenizer pool (tokenize, render chat templates) and its result; `size`:
        the input's characters, which pick the pool's lane (ServerBusyError when the large lane is full)."""
        self._check_running()
        return await self.tokenizer_pool.run(fn, self.inputs, size=size)

    async def add_requests(self, request_id: str, prompts: list, params: list[SamplingParams]) -> RequestStream:
        """Check ALL prompts/params here, then send them to the core together (all or nothing): ValueError /
        NotImplementedError before anything is queued. Engine request ids are `{request_id}-{i}`."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError("add_requests needs one SamplingParams per prompt and at least one prompt")
        if any(getattr(p, "output_kind", None) is RequestOutputKind.DELTA for p in params):
            raise ValueError("output_kind DELTA is not supported here (a stream keeps only the newest output); "
                             "use CUMULATIVE or FINAL_ONLY")
        self._check_running()
        self._check_awake()  # before tokenizing: no work for a request that cannot run
        # The routes pass token ids (tokenized on the pool already), so this is the checks, plus bad_words
        # (up to --max-bad-words encodes) and structured-output checks: on the pool, sized by the bad words'
        # characters. Just the id checks of a bounded prompt (~µs) run here: the thread hop costs more.
        size = sum(len(w) for p in params for w in (p.bad_words or ()))
        if size == 0 and checks_only(prompts, params):
            prepared = self.inputs.prepare_requests(prompts, params)
        else:
            prepared = await self.tokenizer_pool.run(InputProcessor.prepare_requests, self.inputs, prompts, params,
                                                     size=size)
        self._check_running()
        self._check_awake()  # again, with no await before the send: see sleep()
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, self._loop)
        now = time.monotonic()
        for i, (rid, prep) in enumerate(zip(ids, prepared)):
            self._router.add(rid, prep, Tracked(stream, i, prep.params.n, now))
        self._send(ADD, list(zip(ids, prepared)))
        for prep in prepared:
            self.stats.on_request_added(len(prep.prompt_token_ids), prep.params.n, prep.params.has_trace)
        if self._running:  # other requests' tokens that came while this intake ran (CoreOutputReader)
            self._outputs.poll()
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); the core frees their KV blocks at once."""
        aborted = self._router.abort(request_ids, RequestAborted)
        if aborted and self._running:
            self._send(ABORT, aborted)

    async def call_utility(self, method: str, *args) -> Any:
        """Call an engine-core utility method (core_proc.UTILITY_METHODS) between steps; its result."""
        self._check_running()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(UTILITY, (call_id, method, list(args)))
        return await future

    # -- EngineAdmin ------------------------------------------------------------------------------------
    async def engine_call(self, method: str, *args: Any) -> Any:
        """A utility call; the core's ValueError comes back as a ValueError (the caller's mistake)."""
        try:
            return await self.call_utility(method, *args)
        except EngineCallError as e:
            if e.type_name == "ValueError":
                raise ValueError(e.message) from None
            raise

    async def sleep(self, level: int = 1) -> None:
        async with self._admin_lock:
            was_asleep = self._asleep
            # Set before the command goes: commands reach the core in the order sent, so a request sent before it
            # is in flight there (the sleep fails: not idle) and none is sent after it (EngineAsleepError here).
            self._asleep = True
            try:
                await super().sleep(level)
            except BaseException:
                self._asleep = was_asleep  # a refused sleep changed nothing
                raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        async with self._admin_lock:
            await super().wake_up(tags)
            self._asleep = await super().is_sleeping()  # waking one part leaves the engine asleep

    async def update_weights_from_disk(self, model_path: str) -> int:
        async with self._admin_lock:  # not in the middle of a sleep or a wake-up
            return await super().update_weights_from_disk(model_path)

    # -- internals ---------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if not self._running:
            raise EngineDeadError("the engine core is not running")

    def _check_awake(self) -> None:
        # One API server: its mirror is the core's state. Several: another one may have slept or woken the core, so
        # the state is the core's, from the snapshot every process receives with the message that answered the
        # sleep or wake-up call; a request sent in the instant before that message is read is still refused by the
        # core (CoreOutputs.asleep), in its stream.
        if self._asleep if self.num_clients == 1 else self.snapshot.sleeping:
            raise EngineAsleepError("the engine is asleep (sleep mode): wake it up before sending requests")

    def _send(self, kind: str, payload) -> None:
        self._input.send(encode_command(kind, payload, self._client), copy=False)

    def send_abort(self, request_ids: list[str]) -> None:
        """Abort in the core only (the router finished these itself, e.g. at a stop string)."""
        if self._running:
            self._send(ABORT, request_ids)

    def resolve_call(self, call_id: int, ok: bool, result) -> None:
        future = self._calls.pop(call_id, None)
        if future is not None and not future.done():
            if ok:
                future.set_result(result)
            else:
                future.set_exception(EngineCallError(result))

    def _core_exited(self) -> None:
        self._die(f"the engine core process died (exit code {self._watch.exitcode})")  # None: not our child

    def _die(self, reason: str) -> None:
        if self._stopping or not self._running:
            return
        logger.error("%s: failing every request in flight", reason)
        self._running = False
        self._stop_watching()
        self._fail_all(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    def _stop_watching(self) -> None:
        sentinel = self._watch.sentinel() if self._watch is not None else None
        if self._loop is not None and sentinel is not None:
            self._loop.remove_reader(sentinel)

    def _fail_all(self, error: BaseException) -> None:
        self._router.fail_all(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
