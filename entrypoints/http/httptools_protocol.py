"""GuardedHttpToolsProtocol: uvicorn's httptools (llhttp) connection with ConnectionGuard's cap and timeouts,
the h11 protocol's caps on a request head, and JSON 4xx answers. `replayllm serve`'s default when httptools is
installed: it parses a request for about half the CPU of h11 (docs/serving.md, "HTTP protocol")."""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from .connection_guard import ConnectionGuard, HeadError, error_answer, head_size, too_many_headers


class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
    """One client connection. llhttp hands a head over piece by piece and keeps no bound on it, so the caps
    are counted here:
    - header fields: each one as it is parsed (past --h11-max-header-count: 431 at once);
    - head bytes: a head that arrived whole is measured as h11 measures it (method, target, "Name: value\\r\\n"
      per field); one still incomplete is bounded by the bytes received since it began (past
      --h11-max-incomplete-event-size: 431). A head that began inside a read that also held the end of the
      previous request's body is counted from the next read on, so such a head may exceed the cap by at
      most that one read before it is refused (no head is refused below the cap).
    A malformed request gets an OpenAI-style JSON 400. Cycles this protocol starts are marked `guarded`
    (http_protocol.direct_chunk_writer frames their chunks straight onto the socket)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.error: HeadError | None = None  # the head error raised last (uvicorn's handler does not pass it on)
        self._in_message = False  # between llhttp's message begin and complete
        self._in_head = False  # between message begin and headers complete
        self._head_bytes = 0  # bytes received for the current head while it is incomplete
        self._began = False  # a message began during the current read

    def _reject(self, error: HeadError) -> HeadError:
        self.error = error
        return error  # raised in a parser callback: llhttp stops, uvicorn answers send_400_response

    # -- parser callbacks -----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = self._in_head = self._began = True
        self._head_bytes = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        limit = self.limits.h11_max_header_count
        if len(self.headers) >= limit:
            raise self._reject(too_many_headers(len(self.headers) + 1, limit))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if head_size(self.parser.get_method(), self.url, self.headers) > self.limits.h11_max_incomplete_event_size:
            raise self._reject(HeadError("request head too large", 431))
        self._on_request_head()
        previous = self.cycle
        super().on_headers_complete()
        if self.cycle is not previous:
            self.cycle.guarded = True

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    # -- transport ------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        mid_body = self._in_message and not self._in_head  # this read may begin with a previous body's end
        self._began = False
        super().data_received(data)  # ConnectionGuard's timers, then llhttp (the callbacks above)
        if self._in_head and not self.transport.is_closing():  # the head is still incomplete after this read
            if not (self._began and mid_body):
                self._head_bytes += len(data)
            if self._head_bytes > self.limits.h11_max_incomplete_event_size:
                self._reject(HeadError("request head too large", 431))
                self.send_400_response("request head too large")

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # a queued request starts in super(): it is in flight from then on
        super().on_response_complete()
        if pipelined and not self.transport.is_closing():
            self.in_request = True
            self.idle.pop(self, None)
            self._update_body_timer()

    def send_400_response(self, msg: str) -> None:
        status, body = error_answer(self.error, self.limits)
        content = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            content += [name, b": ", value, b"\r\n"]
        content += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                    b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(content))
        self.transport.close()
