"""GuardedH11Protocol: uvicorn's h11 connection with a connection cap, header/body timeouts and JSON 4xx."""

from __future__ import annotations

import json
import logging
import time

import h11
from h11._writers import ChunkedWriter
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connection_limits import ConnectionLimits
from .errors import APIError

logger = logging.getLogger("uvicorn.error")  # its warnings go through the server's repeat filter


class _GuardedConnection(h11.Connection):
    """h11's server side plus caps on header fields and on the size of a head that arrived whole (h11 bounds
    only what it buffers while a head is incomplete); remembers the protocol error it raised last, which
    uvicorn's handler does not pass on, and tells the protocol when a request's head has arrived."""

    def __init__(self, max_incomplete_event_size: int, max_header_count: int, on_request_head):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.max_head_size = max_incomplete_event_size
        self.max_header_count = max_header_count
        self.on_request_head = on_request_head
        self.error: h11.RemoteProtocolError | None = None

    def next_event(self):
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise
        if isinstance(event, h11.Request):
            if len(event.headers) > self.max_header_count:
                self.error = h11.RemoteProtocolError(
                    f"too many header fields: {len(event.headers)}; this server accepts at most "
                    f"{self.max_header_count} (--h11-max-header-count)", error_status_hint=431)
                raise self.error
            size = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
            if size > self.max_head_size:  # "Name: value\r\n" per field
                self.error = h11.RemoteProtocolError("request head too large", error_status_hint=431)
                raise self.error
            self.on_request_head()
        return event

    def sends_chunked_body(self) -> bool:
        """True while our response's body goes out chunked (HTTP/1.1 without Content-Length): framing a data
        chunk then needs no state (h11's ChunkedWriter keeps none), so it may be written without h11."""
        return self.our_state is h11.SEND_BODY and isinstance(self._writer, ChunkedWriter)


class DirectChunkWriter:
    """Frames chunks of a chunked response body and puts them straight on the connection's transport (the
    bytes h11 would write, with uvicorn's flow control and disconnect check), for a streamed completion's
    per-token chunks: h11's event machinery and uvicorn's ASGI send cost more than the socket write itself.
    `await writer(data)` waits for the transport to drain first; `writable()` / `write_now(data)` are the
    synchronous path (the engine output router writing a step's chunks in one pass)."""

    def __init__(self, cycle):
        self._cycle, self._transport, self._flow = cycle, cycle.transport, cycle.flow

    def writable(self) -> bool:
        """The chunk can go out now: the transport is under its high-water mark, the response still open."""
        cycle = self._cycle
        return not (self._flow.write_paused or cycle.disconnected or cycle.response_complete)

    def write_now(self, data: bytes) -> None:
        """One chunk onto the transport (only when `writable()`: this never waits; empty data writes nothing,
        as an empty chunk would end the body)."""
        if data:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def __call__(self, data: bytes) -> None:
        cycle = self._cycle
        if self._flow.write_paused and not cycle.disconnected:
            await self._flow.drain()
        if not cycle.disconnected and not cycle.response_complete:
            self.write_now(data)


def direct_chunk_writer(send) -> DirectChunkWriter | None:
    """The DirectChunkWriter of `send`, the server's own ASGI send (uvicorn's RequestResponseCycle.send on a
    GuardedH11Protocol connection) after the response start was sent; None when it is anything else (a test
    client, another server), and the caller then uses `send`."""
    cycle = getattr(send, "__self__", None)
    conn = getattr(cycle, "conn", None)
    if not isinstance(conn, _GuardedConnection) or not conn.sends_chunked_body():
        return None
    return DirectChunkWriter(cycle)


class GuardedH11Protocol(H11Protocol):
    """One client connection. On top of uvicorn's h11 protocol (whose keep-alive timeout still applies):
    - at most `limits.limit_concurrency` connections are kept: a new one past it closes the connection that
      has waited longest for a request (idle keep-alive or a slow head), never one with a request in flight;
    - a request head must arrive within `timeout_header` s of the connection opening (or of its first byte
      after a keep-alive wait), and a body the app is reading must not stall for `timeout_body` s: a slow
      client (slowloris) is dropped instead of holding a socket forever;
    - malformed requests, a head over --h11-max-incomplete-event-size or --h11-max-header-count get an
      OpenAI-style JSON 400/431 instead of plain text.
    `limits` is set on the subclass `protocol_class(limits)` makes (uvicorn builds one instance per connection)."""

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _GuardedConnection(self.limits.h11_max_incomplete_event_size, self.limits.h11_max_header_count,
                                       self._on_request_head)
        self.in_request = False  # a request head arrived and its response is not complete
        self.waiting_since = time.monotonic()  # when this connection began waiting for a request (eviction order)
        self._head_timer = None  # asyncio.TimerHandle: fires timeout_header after the head began
        self._body_timer = None  # fires when a body being read stalls for timeout_body

    # -- connection cap -------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()
        if len(self.connections) > self.limits.limit_concurrency:
            self._evict_one()

    def _evict_one(self) -> None:
        idle = [c for c in self.connections
                if c is not self and not getattr(c, "in_request", True) and not c.transport.is_closing()]
        if idle:  # none idle: every other connection has a request in flight, which the request cap bounds
            oldest = min(idle, key=lambda c: c.waiting_since)
            logger.warning("connection cap (--limit-concurrency %d) reached: closing the longest-idle connection",
                           self.limits.limit_concurrency)
            oldest.transport.close()

    # -- timeouts -------------------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.timeout_header, self._on_timeout, "header")

    def _on_request_head(self) -> None:
        self.in_request = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_timeout(self, what: str) -> None:
        if what == "body":
            self._body_timer = None
            if self.flow.read_paused:  # the app is not reading: the client is not the slow one
                self._update_body_timer()
                return
        else:
            self._head_timer = None
        if not self.transport.is_closing():
            limit = self.limits.timeout_header if what == "header" else self.limits.timeout_body
            logger.warning("closing a connection: no complete request %s within %.0f s (--timeout-%s)",
                           what, limit, what)
            self.transport.close()

    def _update_body_timer(self) -> None:
        """(Re)arm while the current request's body is still coming in; cancel otherwise."""
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        cycle = self.cycle
        if self.in_request and cycle is not None and cycle.more_body and not cycle.response_complete:
            self._body_timer = self.loop.call_later(self.limits.timeout_body, self._on_timeout, "body")

    def data_received(self, data: bytes) -> None:
        if not self.in_request:
            self._arm_head_timer()
        super().data_received(data)
        self._update_body_timer()

    def on_response_complete(self) -> None:
        self.in_request = False
        self.waiting_since = time.monotonic()
        super().on_response_complete()  # may start a pipelined request (in_request again)
        self._update_body_timer()

    def connection_lost(self, exc) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)

    # -- errors as JSON -------------------------------------------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        error = self.conn.error
        status = error.error_status_hint if error is not None else 400
        if status == 431 and error is not None and "too many header" in str(error):
            message = str(error)
        elif status == 431:
            message = ("the request line and headers are too large; this server accepts at most "
                       f"{self.limits.h11_max_incomplete_event_size} bytes (--h11-max-incomplete-event-size)")
        else:
            status, message = 400, "invalid HTTP request"
        body = json.dumps(APIError(status, message, code="invalid_http_request").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # too broken to answer (h11 refuses to respond): just close
            pass
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to hand uvicorn (`Config(http=...)`), bound to these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
