"""SSEResponse: a streamed completion's ASGI response, its body chunks written past the middleware send chain."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import StreamingResponse

from ...outputs import RequestOutput
from ..http.http_protocol import DirectChunkWriter, direct_chunk_writer
from ..http.intake_gate import gated, leave_intake
from .streaming import SSEBody

# The server's own `send` (uvicorn's), stored in the scope by ReplayFastAPI before any middleware wraps it.
RAW_SEND = "replayllm.raw_send"


class ReplayFastAPI(FastAPI):
    """FastAPI that keeps the server's unwrapped `send` in the scope (RAW_SEND) for SSEResponse, and, when
    `state.intake_gate` is set (REPLAYLLM_INTAKE_GATE, http/intake_gate.py), passes a generation request whose
    body is in through it before any other work on it; its place is given back at the request's hand-off to
    the engine (ServingBase.queue) or when the call ends, whichever comes first."""

    async def __call__(self, scope, receive, send) -> None:
        scope[RAW_SEND] = send
        gate = getattr(self.state, "intake_gate", None)
        if gate is None or not gated(scope, send, gate.max_body):
            return await super().__call__(scope, receive, send)
        await gate.enter()
        try:
            await super().__call__(scope, receive, send)
        finally:
            leave_intake()


class SSEResponse(StreamingResponse):
    """text/event-stream of an SSEBody. The response start and the final empty body go through the middleware
    chain (CORS headers, the status recorded for /metrics, ...); each data chunk in between goes straight to the
    server's `send` (every middleware here only acts on the start message, and a streamed token otherwise paid
    ~8 wrapper coroutines, one per middleware, per chunk), or, on `replayllm serve`'s own h11 connections,
    straight to the socket as a framed chunk (http_protocol.direct_chunk_writer). Disconnects: the body's own
    watcher (streaming.py) ends the stream, so no second receive task runs here (starlette's StreamingResponse
    starts one per response). However the response ends, `close()` aborts the call's unfinished requests.

    On those h11 connections the body's renderer is also installed as the stream's sink (`direct_sink`): the
    engine output router then renders and writes each unfinished output's chunk in its own pass over the step,
    and this task (the reader) wakes only to start, to finish (last chunk, usage, [DONE]), for errors and
    disconnects, and under back-pressure (a transport over its high-water mark: the queued path, which waits
    for the drain)."""

    def __init__(self, body: SSEBody):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.sse_body = body

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            raw_send = scope.get(RAW_SEND, send)
            write = direct_chunk_writer(raw_send)
            if write is not None:  # uvicorn's h11 connection (`replayllm serve`): frame the chunks here
                if self.sse_body.render is not None:
                    self.sse_body.stream.sink = direct_sink(self.sse_body, write)
                async for chunk in self.sse_body:
                    await write(chunk)
            else:
                async for chunk in self.sse_body:
                    await raw_send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.sse_body.stream.sink = None
            self.sse_body.close()


def direct_sink(body: SSEBody, writer: DirectChunkWriter):
    """RequestStream.sink for `body`: render an output's chunk and write it now, or decline (False) when the
    transport cannot take it now. An error ends this stream only (the reader turns it into an SSE error event,
    as on the queued path); it never reaches the output router, which serves every stream."""
    render, stream = body.render, body.stream

    def sink(index: int, out: RequestOutput) -> bool:
        if not writer.writable():
            return False
        try:
            writer.write_now(render(index, out))
        except Exception as e:  # noqa: BLE001 - reported to the client in-band by the reader, never the router's
            stream.fail(e)
        return True

    return sink
