"""RequestStream: one call's engine outputs on the event loop, the errors that end it, and per-request timing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from ..outputs import RequestOutput
from .engine_stats import RequestTiming


class _Aborts(Protocol):
    """What a stream needs of its engine (AsyncLLMEngine, or the core client)."""

    def abort(self, request_ids: list[str]) -> None: ...


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error): nothing more can be served."""


class EngineAsleepError(RuntimeError):
    """The engine is asleep (sleep mode): new requests are refused until wake_up (not a ValueError: the request
    itself is fine, the server answers 503)."""


class EngineStepError(RuntimeError):
    """An engine step raised; every request in flight was failed with this error (the loop keeps serving)."""


class ClientDisconnected(Exception):
    """The HTTP client went away; its requests were aborted."""


class RequestAborted(Exception):
    """The request was aborted before it finished."""


# A streaming response's direct writer: renders and writes one output's chunk at delivery, on the event loop;
# False when it cannot write now (back-pressure, a closed connection), and the output then takes the queued path.
OutputSink = Callable[[int, RequestOutput], bool]


class RequestStream:
    """The outputs of one call's engine requests (one per prompt) as `(prompt index, RequestOutput)`.

    Lives on the event loop; the engine thread feeds it through `loop.call_soon_threadsafe`. Outputs are
    cumulative (or, with output_kind FINAL_ONLY, only the final one), so an unread older output is replaced by
    a newer one: a slow reader skips, it never lags. DELTA outputs would be lost that way: refused at add.
    Leaving `outputs()` early (exception, cancellation, close) aborts whatever has not finished.

    Direct delivery (`sink`): while the reader is parked with nothing pending, an unfinished output goes to the
    sink (the streaming response's renderer and writer), called right here by the deliverer, and the reader is
    not woken: one pass over a step's outputs renders and writes every stream's chunk. A finished output, an
    error, or a sink that declines (False) takes the queued path, which wakes the reader; so bytes are never
    reordered: the sink only writes when everything delivered earlier has been written."""

    def __init__(self, engine: _Aborts, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self.request_ids = request_ids
        self._loop = loop
        self._pending: dict[int, RequestOutput] = {}
        self._unfinished = set(range(len(request_ids)))
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits (a bare future: an Event's
        # set/clear/wait cost ~3x this on the per-token path)
        self.sink: OutputSink | None = None  # set by a streaming response that writes its chunks directly

    # -- engine thread ---------------------------------------------------------------------------------
    def deliver_threadsafe(self, index: int, item: RequestOutput | BaseException) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver, index, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # -- event loop ------------------------------------------------------------------------------------
    def deliver(self, index: int, item: RequestOutput | BaseException) -> None:
        """Hand over the newest output of prompt `index` (or an error that ends the stream)."""
        self._deliver(index, item)

    def sink_ready(self) -> bool:
        """The sink may take an unfinished output now: one is set, the reader is parked, nothing is queued
        before it (its chunks stay in order) and no error ends the stream."""
        waiter = self._waiter
        return (self.sink is not None and waiter is not None and not waiter.done() and not self._pending
                and self._error is None)

    def _deliver(self, index: int, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            if not item.finished and self.sink_ready() and self.sink(index, item):
                return  # written directly; the reader stays parked
            self._pending[index] = item
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        """Stop the reader with `error` (e.g. ClientDisconnected from a disconnect watcher)."""
        self._deliver(-1, error)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._unfinished:
                if self._error is not None:
                    raise self._error
                if not self._pending:
                    self._waiter = self._loop.create_future()
                    await self._waiter
                    continue
                ready = sorted(self._pending.items())
                self._pending.clear()
                for index, out in ready:
                    if out.finished:
                        self._unfinished.discard(index)
                    yield index, out
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort the unfinished requests (a no-op once all have finished)."""
        ids = [self.request_ids[i] for i in sorted(self._unfinished)]
        self._unfinished.clear()
        if ids:
            self._engine.abort(ids)


@dataclass
class Tracked:
    """Bookkeeping for one engine request (engine thread, or the core client's event loop)."""

    stream: RequestStream
    index: int
    num_seqs: int
    added: float  # time.monotonic() of each stamp; None until it happens
    scheduled: float | None = None
    first_token: float | None = None


def request_timing(tracked: Tracked, out: RequestOutput, started: float, now: float) -> RequestTiming:
    """A finished request's RequestTiming (stamps it never got happened in this, its last, step)."""
    scheduled = tracked.scheduled if tracked.scheduled is not None else started
    first = tracked.first_token if tracked.first_token is not None else now
    longest = max((len(c.token_ids) for c in out.outputs), default=0)
    return RequestTiming(
        queue_time=scheduled - tracked.added, time_to_first_token=first - tracked.added,
        e2e_latency=now - tracked.added, num_prompt_tokens=len(out.prompt_token_ids),
        num_generation_tokens=sum(len(c.token_ids) for c in out.outputs), num_cached_tokens=out.num_cached_tokens,
        time_per_output_token=(now - first) / (longest - 1) if longest > 1 else None)
