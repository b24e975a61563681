"""ConnectionGuard: the connection cap, head/body timeouts and JSON 4xx answers shared by `replayllm serve`'s
HTTP/1.1 protocols (http_protocol.GuardedH11Protocol, httptools_protocol.GuardedHttpToolsProtocol)."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from .connection_limits import ConnectionLimits
from .errors import APIError

logger = logging.getLogger("uvicorn.error")  # its warnings go through the server's repeat filter


class HeadError(Exception):
    """A request head this server refuses; `error_status_hint` as h11's RemoteProtocolError (400 or 431)."""

    def __init__(self, message: str, error_status_hint: int = 400):
        super().__init__(message)
        self.error_status_hint = error_status_hint


def too_many_headers(count: int, limit: int) -> HeadError:
    return HeadError(f"too many header fields: {count}; this server accepts at most {limit} "
                     "(--h11-max-header-count)", 431)


def head_size(method: bytes | str, target: bytes, headers) -> int:
    """Bytes of a request head as counted against --h11-max-incomplete-event-size: the method, the target and
    "Name: value\\r\\n" per field."""
    return len(method) + len(target) + sum(len(k) + len(v) + 4 for k, v in headers)


def error_answer(error: Exception | None, limits: ConnectionLimits) -> tuple[int, bytes]:
    """(status, OpenAI-style JSON body) for a head the protocol rejected; `error` carries `error_status_hint`
    (HeadError, h11's RemoteProtocolError) or is None (a parse error without one: 400)."""
    status = getattr(error, "error_status_hint", 400) if error is not None else 400
    if status == 431 and "too many header" in str(error):
        message = str(error)
    elif status == 431:
        message = ("the request line and headers are too large; this server accepts at most "
                   f"{limits.h11_max_incomplete_event_size} bytes (--h11-max-incomplete-event-size)")
    else:
        status, message = 400, "invalid HTTP request"
    return status, json.dumps(APIError(status, message, code="invalid_http_request").body()).encode()


class ConnectionGuard:
    """Mixed in before a uvicorn HTTP protocol class (uvicorn's keep-alive timeout still applies):
    - at most `limits.limit_concurrency` connections are kept: a new one past it closes the connection that
      has waited longest for a request (idle keep-alive or a slow head), never one with a request in flight;
    - a request head must arrive within `timeout_header` s of the connection opening (or of its first byte
      after a keep-alive wait), and a body the app is reading must not stall for `timeout_body` s: a slow
      client (slowloris) is dropped instead of holding a socket forever.
    The protocol calls `_on_request_head()` when a head has arrived whole (and passed its checks).
    `limits` and `idle` are set on the subclass `http_protocol.protocol_class(limits)` makes (one instance per
    connection): `idle` holds the server's connections waiting for a request, longest-waiting first, so the
    cap finds the one to close without walking every connection (a flood past a cap of thousands would
    otherwise cost the event loop milliseconds per new connection)."""

    limits: ConnectionLimits
    idle: OrderedDict  # connection -> None, in the order they began waiting for a request

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.in_request = False  # a request head arrived and its response is not complete
        self._head_timer = None  # asyncio.TimerHandle: fires timeout_header after the head began
        self._body_timer = None  # fires when a body being read stalls for timeout_body

    # -- connection cap -------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle[self] = None
        self._arm_head_timer()
        if len(self.connections) > self.limits.limit_concurrency:
            self._evict_one()

    def _evict_one(self) -> None:
        # Oldest first; a connection already closing (a timeout's) is skipped. None idle: every other
        # connection has a request in flight, which the request cap bounds.
        oldest = next((c for c in self.idle if c is not self and not c.transport.is_closing()), None)
        if oldest is not None:
            del self.idle[oldest]
            logger.warning("connection cap (--limit-concurrency %d) reached: closing the longest-idle connection",
                           self.limits.limit_concurrency)
            oldest.transport.close()

    # -- timeouts -------------------------------------------------------------------------------------------
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.timeout_header, self._on_timeout, "header")

    def _on_request_head(self) -> None:
        self.in_request = True
        self.idle.pop(self, None)
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
        self.idle[self] = None  # the newest to wait (a pipelined request started below takes it out again)
        super().on_response_complete()  # may start a pipelined request
        self._update_body_timer()

    def connection_lost(self, exc) -> None:
        self.idle.pop(self, None)
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        super().connection_lost(exc)
