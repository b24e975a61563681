"""CoreOutputReader: the API server process's end of the engine core's output socket (ZeroMQ PULL)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from .core_messages import OUTPUTS_DECODER, CoreOutputs

logger = logging.getLogger(__name__)
# Engine steps routed together when several queued up (one delivery per request for all of them): bounds the
# work of one pass of the event loop.
MAX_COALESCED_STEPS = 64


class CoreOutputReader:
    """Takes the core's CoreOutputs messages off the output socket and hands them to `route` (the output router's
    apply_many), in order. Two takers share the socket: the event loop's reader callback, registered on the
    socket's file descriptor by `run`, and `poll`, called by the client after each request's hand-off. A burst of
    arrivals is one event-loop pass that runs every ready request's intake back to back (~1 ms of CPU each: HTTP,
    parsing, checks), so the callback alone would hold the running requests' tokens back for the whole burst
    (session 24: S1's first wave got its first tokens together after ~650 ms). Both take frames with non-blocking
    receives only. A routing failure calls `on_error` (the client fails everything in flight).

    The socket is a plain (blocking-API) zmq socket watched with `loop.add_reader`, not zmq.asyncio: its poll
    machinery (a future, a callback and enum flag work per wake-up) cost ~100-150 µs of the API process's CPU per
    engine step, a third of a batch-1 step's API work (session 28). ZeroMQ's descriptor is edge-triggered: it
    signals when the socket's state may have changed, and re-arms only once ZMQ_EVENTS has been read with no
    POLLIN left, so every taker drains until EVENTS says empty, or schedules another pass when it stopped at
    MAX_COALESCED_STEPS with frames left."""

    def __init__(self, route: Callable[[list[CoreOutputs]], None], on_error: Callable[[str], None]):
        self._route, self._on_error = route, on_error
        self.socket = None  # zmq.Socket PULL (bind); None when closed
        self._loop: asyncio.AbstractEventLoop | None = None  # set while the descriptor is watched
        self._fd = -1
        self._stopped: asyncio.Future | None = None  # run's future: done on a failure

    def bind(self, context, path: str) -> None:
        """Bind the PULL socket at `path` on `context` (a zmq.Context; a zmq.asyncio one is used through a
        plain shadow of it)."""
        import zmq

        self.socket = zmq.Context.shadow(context.underlying).socket(zmq.PULL)
        self.socket.bind(path)

    async def run(self) -> None:
        """Route messages as they come, until cancelled (the reader task) or a routing failure."""
        import zmq

        loop = asyncio.get_running_loop()
        self._stopped = loop.create_future()
        self._loop, self._fd = loop, self.socket.get(zmq.FD)
        loop.add_reader(self._fd, self._readable)
        loop.call_soon(self._readable)  # frames that came before the watch: the descriptor signals edges only
        try:
            await self._stopped
        finally:
            self._unwatch()

    def poll(self) -> None:
        """Route what has already arrived, now, without waiting (nothing when closed)."""
        self._readable()

    def close(self) -> None:
        self._unwatch()
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = None

    def _readable(self) -> None:
        """Drain the socket (the reader callback, and poll). A drain cut at MAX_COALESCED_STEPS leaves POLLIN set,
        which the edge-triggered descriptor will not signal again: the rest is taken on the loop's next pass."""
        if self.socket is None:
            return
        try:
            if self._drain() == MAX_COALESCED_STEPS and self._loop is not None:
                self._loop.call_soon(self._readable)
        except Exception:
            self._failed()

    def _drain(self) -> int:
        """Route up to MAX_COALESCED_STEPS queued messages in one call (one delivery per request for all of them:
        steps that queued while the event loop was busy); how many there were."""
        import zmq

        frames, sock = [], self.socket
        # EVENTS first: an empty poll (most hand-offs) costs no exception, and reading it re-arms the descriptor.
        while len(frames) < MAX_COALESCED_STEPS and sock.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames.append(sock.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        if frames:
            self._route([OUTPUTS_DECODER.decode(f.buffer) for f in frames])
        return len(frames)

    def _unwatch(self) -> None:
        if self._loop is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            self._loop, self._fd = None, -1

    def _failed(self) -> None:
        logger.exception("reading the engine core's outputs failed")
        self._unwatch()
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
        self._on_error("the engine core's output stream failed")
