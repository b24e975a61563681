"""`replayllm serve`'s HTTP/1.1 protocol (`protocol_class`): httptools or h11 with ConnectionGuard's cap,
timeouts and JSON 4xx; DirectChunkWriter, a streamed body's chunks framed straight onto the socket."""

from __future__ import annotations

import importlib.util
from collections import OrderedDict

import h11
from h11._writers import ChunkedWriter
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connection_guard import ConnectionGuard, error_answer, head_size, too_many_headers
from .connection_limits import HTTP_PROTOCOLS, ConnectionLimits


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
                error = too_many_headers(len(event.headers), self.max_header_count)
                self.error = h11.RemoteProtocolError(str(error), error_status_hint=431)
                raise self.error
            if head_size(event.method, event.target, event.headers) > self.max_head_size:
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
    GuardedH11Protocol or GuardedHttpToolsProtocol connection) once the response start has gone out with a
    chunked body; None when it is anything else (a test client, another server, a HEAD or sized response),
    and the caller then uses `send`."""
    cycle = getattr(send, "__self__", None)
    conn = getattr(cycle, "conn", None)
    if isinstance(conn, _GuardedConnection):
        chunked = conn.sends_chunked_body()
    else:  # a GuardedHttpToolsProtocol cycle: its chunked framing is a flag, no state
        chunked = (getattr(cycle, "guarded", False) and cycle.chunked_encoding is True
                   and cycle.response_started and not cycle.response_complete)
    return DirectChunkWriter(cycle) if chunked else None


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """One client connection on uvicorn's h11 protocol with ConnectionGuard's cap and timeouts; a malformed
    request, a head over --h11-max-incomplete-event-size or --h11-max-header-count gets an OpenAI-style JSON
    400/431 instead of plain text. The fallback when httptools is not installed (`--http h11`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = _GuardedConnection(self.limits.h11_max_incomplete_event_size, self.limits.h11_max_header_count,
                                       self._on_request_head)

    def send_400_response(self, msg: str) -> None:
        status, body = error_answer(self.conn.error, self.limits)
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # too broken to answer (h11 refuses to respond): just close
            pass
        self.transport.close()


def protocol_class(limits: ConnectionLimits, http: str = "auto") -> type[ConnectionGuard]:
    """The protocol class to hand uvicorn (`Config(http=...)`), bound to these limits. `http` (--http): "h11",
    "httptools" (ValueError when it is not installed) or "auto": httptools when installed, else h11. httptools
    (llhttp, C) parses a request for about half the CPU of h11 (pure Python): docs/serving.md."""
    if http not in HTTP_PROTOCOLS:
        raise ValueError(f"--http must be one of {', '.join(HTTP_PROTOCOLS)}, got {http!r}")
    has_httptools = importlib.util.find_spec("httptools") is not None
    if http == "httptools" and not has_httptools:
        raise ValueError("--http httptools needs the httptools package (pip install httptools), or use --http h11")
    if http == "h11" or not has_httptools:
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "idle": OrderedDict()})
    from .httptools_protocol import GuardedHttpToolsProtocol
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits, "idle": OrderedDict()})
