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
    apply_many), in order. Two takers share the socket: the `run` task, woken when the socket becomes readable,
    and `poll`, called by the client after each request's hand-off. A burst of arrivals is one event-loop pass
    that runs every ready request's intake back to back (~1 ms of CPU each: HTTP, parsing, checks), so the task
    alone would hold the running requests' tokens back for the whole burst (session 24: S1's first wave got its
    first tokens together after ~650 ms). Both take frames with non-blocking receives only, so no frame ever
    waits inside a finished receive future while later ones are routed. A routing failure calls `on_error`
    (the client fails everything in flight)."""

    def __init__(self, route: Callable[[list[CoreOutputs]], None], on_error: Callable[[str], None]):
        self._route, self._on_error = route, on_error
        self.socket = None  # zmq.asyncio PULL socket (bind); None when closed
        self._queued = None  # the same socket without the asyncio wrapper (zmq.Socket.shadow): never waits

    def bind(self, context, path: str) -> None:
        """Bind the PULL socket at `path` on `context` (a zmq.asyncio.Context)."""
        import zmq

        self.socket = context.socket(zmq.PULL)
        self.socket.bind(path)
        self._queued = zmq.Socket.shadow(self.socket.underlying)

    async def run(self) -> None:
        """Route messages as they come, until cancelled (the reader task)."""
        import zmq

        try:
            while True:
                await self.socket.poll(flags=zmq.POLLIN)  # readiness only: the frames are taken by _drain
                self._drain()
        except asyncio.CancelledError:
            raise
        except Exception:
            self._failed()

    def poll(self) -> None:
        """Route what has already arrived, now, without waiting (nothing when closed)."""
        if self.socket is None:
            return
        try:
            self._drain()
        except Exception:
            self._failed()

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = self._queued = None

    def _drain(self) -> int:
        """Route up to MAX_COALESCED_STEPS queued messages in one call (one delivery per request for all of them:
        steps that queued while the event loop was busy); how many there were."""
        import zmq

        frames, queued = [], self._queued
        # EVENTS first: an empty poll (most hand-offs) costs no exception.
        while len(frames) < MAX_COALESCED_STEPS and queued.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames.append(queued.recv(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        if frames:
            self._route([OUTPUTS_DECODER.decode(f.buffer) for f in frames])
        return len(frames)

    def _failed(self) -> None:
        logger.exception("reading the engine core's outputs failed")
        self._on_error("the engine core's output stream failed")
