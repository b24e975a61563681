"""AsyncLLMEngine: one background thread owns the (not thread-safe) LLMEngine; asyncio callers get streams."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from ..outputs import FlatLogprobs, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .engine_admin import EngineAdmin
from .engine_stats import EngineSnapshot, StatsSink
from .llm_engine import LLMEngine
from .request_stream import (
    EngineAsleepError,
    EngineDeadError,
    EngineStepError,
    RequestAborted,
    RequestStream,
    Tracked,
    request_timing,
)
from .tokenizer_pool import TokenizerPool, TokenizerPoolConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")


_STOP = object()


class AsyncLLMEngine(EngineAdmin):
    """Drives an LLMEngine from ONE background thread: it runs queued commands (add, abort, any callable)
    between steps, so requests from concurrent HTTP calls join the same batches, and steps the engine while
    work is pending; idle, it blocks on the command queue. A failing step fails the requests in flight and
    the loop goes on."""

    def __init__(self, engine: LLMEngine, stats: StatsSink | None = None,
                 tokenizer_pool: TokenizerPoolConfig | None = None):
        self.engine = engine
        self.tokenizer_pool = TokenizerPool(tokenizer_pool)  # tokenization off the event loop and this thread
        self.stats = stats or StatsSink()
        self.snapshot = EngineSnapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, Tracked] = {}  # engine thread only
        self._unstarted: set[str] = set()  # tracked ids without a first token yet (engine thread only)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._publish_snapshot()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._thread = threading.Thread(target=self._run, name="replayllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """stop() from the event loop (the server's lifespan end)."""
        self.tokenizer_pool.shutdown()
        await asyncio.to_thread(self.stop)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (after the current step); requests still in flight fail with EngineDeadError."""
        if self._thread is None or self._stopping:
            return
        self._stopping = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- API (event loop) --------------------------------------------------------------------------------
    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (e.g. to read its state) and return its result."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    async def engine_call(self, method: str, *args: Any) -> Any:
        """EngineAdmin's calls: the engine's method on the engine thread, between steps (its ValueError as is)."""
        return await self.run(lambda engine: getattr(engine, method)(*args))

    async def run_tokenizer(self, fn: Callable[[LLMEngine], T], *, size: int) -> T:
        """fn(engine) on the tokenizer pool (tokenize, render chat templates: read-only uses of the engine's
        tokenizer and config, never its scheduler) and its result; `size`: the input's characters, which pick
        the pool's lane (ServerBusyError when the large lane is full)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        return await self.tokenizer_pool.run(fn, self.engine, size=size)

    async def add_requests(self, request_id: str, prompts: list,
                           params: list[SamplingParams]) -> RequestStream:
        """Validate ALL prompts/params on the engine thread, then queue them together (all or nothing).

        Raises ValueError/NotImplementedError for bad input before anything is queued, so callers can answer
        400 before a stream starts. Engine request ids are `{request_id}-{i}`."""
        if len(prompts) != len(params) or not prompts:
            raise ValueError("add_requests needs one SamplingParams per prompt and at least one prompt")
        if any(getattr(p, "output_kind", None) is RequestOutputKind.DELTA for p in params):
            raise ValueError("output_kind DELTA is not supported here (a stream keeps only the newest output); "
                             "use CUMULATIVE or FINAL_ONLY")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        stream = RequestStream(self, ids, asyncio.get_running_loop())
        future = self._submit(lambda: self._add(stream, prompts, params))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(ids)  # queued after the add: cleans up if the add ran anyway
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (unknown or finished ids are ignored); their KV blocks are freed at once."""
        if self.is_running:
            self._commands.put((lambda: self._abort(request_ids), None))

    # -- engine thread -----------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    @staticmethod
    def _execute(fn: Callable[[], Any], future: concurrent.futures.Future | None) -> None:
        if future is None:  # fire and forget (abort): nobody to report to, so log
            try:
                fn()
            except Exception:
                logger.exception("engine command failed")
            return
        if not future.set_running_or_notify_cancel():
            return  # the caller gave up before it ran
        try:
            future.set_result(fn())
        except BaseException as e:  # delivered to the caller, never kills the loop
            future.set_exception(e)

    def _add(self, stream: RequestStream, prompts: list, params: list[SamplingParams]) -> None:
        engine = self.engine
        if engine.is_sleeping():  # on the engine thread, as sleep() itself: no request slips in between
            raise EngineAsleepError("the engine is asleep (sleep mode): wake it up before sending requests")
        # Every check first (tokenize, verify params), once: a bad prompt queues nothing.
        prepared = [engine.prepare_request(prompt, p) for prompt, p in zip(prompts, params)]
        prompt_lens = [len(prep.prompt_token_ids) for prep in prepared]
        added: list[str] = []
        now = time.monotonic()
        try:
            for i, (rid, prep, p) in enumerate(zip(stream.request_ids, prepared, params)):
                engine.add_request(rid, None, prepared=prep)
                added.append(rid)
                self._tracked[rid] = Tracked(stream, i, p.n, now)
                self._unstarted.add(rid)
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
                del self._tracked[rid]
                self._unstarted.discard(rid)
            raise
        for n_prompt, p in zip(prompt_lens, params):
            self.stats.on_request_added(n_prompt, p.n, p.has_trace)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            tracked = self._tracked.pop(rid, None)
            if tracked is None:
                continue
            self.engine.abort_request(rid)
            for _ in range(tracked.num_seqs):
                self.stats.on_seq_finished("abort")
            tracked.stream.deliver_threadsafe(tracked.index, RequestAborted(f"request {rid} was aborted"))

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._turn():
                        return
                except Exception as e:  # a bug outside the step itself: fail what is in flight, keep serving
                    logger.exception("engine loop turn failed")
                    self._fail_all(EngineStepError(f"engine loop error: {type(e).__name__}: {e}"))
        except BaseException:
            logger.exception("the engine loop died")
            raise
        finally:
            self._stopping = True
            self._shut_down()

    def _turn(self) -> bool:
        """Run every queued command, then one step if work is pending. False once told to stop."""
        busy = self.engine.has_unfinished_requests()
        try:
            command = self._commands.get(block=not busy)  # idle: sleep until a command arrives
        except queue.Empty:
            command = None
        while command is not None:  # everything queued joins this step
            if command is _STOP:
                return False
            self._execute(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        if self.engine.has_unfinished_requests():
            self._step()
        self._publish_snapshot()
        return True

    def _shut_down(self) -> None:
        dead = EngineDeadError("the engine loop stopped")
        self._fail_all(dead)
        while True:  # commands that will never run: their callers get the error instead of waiting forever
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command is not _STOP and command[1] is not None and command[1].set_running_or_notify_cancel():
                command[1].set_exception(dead)
        self._publish_snapshot()

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._tracked))
            self.stats.on_step_error()
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        # Counted by the engine (FINAL_ONLY requests report no progress until they finish), and before any
        # output is delivered: a client that reads /metrics right after its response must see its tokens.
        self.stats.on_step(self.engine.last_step_num_reqs, self.engine.last_step_num_new_tokens)
        for rid, error in self.engine.take_rejected():  # e.g. a grammar that did not compile: a 400
            tracked = self._tracked.pop(rid, None)
            if tracked is not None:
                self._unstarted.discard(rid)
                for _ in range(tracked.num_seqs):
                    self.stats.on_seq_finished("error")
                tracked.stream.deliver_threadsafe(tracked.index, error)
        now = time.monotonic()
        self._stamp_progress(started, now)
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            if out.finished:
                del self._tracked[out.request_id]
                self._unstarted.discard(out.request_id)
                for c in out.outputs:
                    self.stats.on_seq_finished(c.finish_reason or "stop")
                if any(c.finish_reason in ("stop", "length") for c in out.outputs):
                    self.stats.on_request_finished(request_timing(tracked, out, started, now))
            tracked.stream.deliver_threadsafe(tracked.index, _snapshot(out))

    def _stamp_progress(self, started: float, now: float) -> None:
        """Stamp the requests this step scheduled first (at its start) or gave a first token (at its end):
        read from the scheduler's requests, as FINAL_ONLY requests deliver no output before they finish."""
        parents, requests = self.engine.output_processor.parents, self.engine.scheduler.requests
        for rid in list(self._unstarted):
            tracked, parent = self._tracked.get(rid), parents.get(rid)
            if tracked is None or parent is None:  # aborted, failed or finished: stamped at finish if at all
                self._unstarted.discard(rid)
                continue
            children = [c for c in map(requests.get, parent.child_ids) if c is not None]
            if tracked.scheduled is None and any(c.num_cached_tokens >= 0 for c in children):
                tracked.scheduled = started
            if any(c.num_output_tokens > 0 for c in children):
                tracked.first_token = now
                self._unstarted.discard(rid)

    def _fail_all(self, error: BaseException) -> None:
        for rid, tracked in list(self._tracked.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # a broken engine must not stop the others from being failed
                logger.exception("could not abort request %s", rid)
            for _ in range(tracked.num_seqs):
                self.stats.on_seq_finished("error")
            tracked.stream.deliver_threadsafe(tracked.index, error)
        self._tracked.clear()
        self._unstarted.clear()

    def _publish_snapshot(self) -> None:
        self.snapshot = EngineSnapshot.of(self.engine)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine keeps appending to the live lists (defensive: cheap,
    and keeps the server safe whether or not RequestOutput is already a snapshot). A finished output is
    handed over as is: the engine has dropped its state and never touches it again."""
    if out.finished:
        return out
    comps = [replace(c, token_ids=list(c.token_ids), logprobs=_copy_logprobs(c.logprobs)) for c in out.outputs]
    prompt_lps = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
    return replace(out, outputs=comps, prompt_logprobs=prompt_lps)


def _copy_logprobs(lps):
    """A copy later appends do not reach: a FlatLogprobs snapshot (no per-token objects built), else a list."""
    if lps is None:
        return None
    return lps.snapshot() if isinstance(lps, FlatLogprobs) else list(lps)

