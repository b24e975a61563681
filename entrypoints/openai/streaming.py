"""Driving a RequestStream for HTTP: disconnect watching, final collection, SSE framing, text deltas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from pydantic import BaseModel

from ...engine.request_stream import (
    ClientDisconnected,
    EngineAsleepError,
    EngineDeadError,
    EngineStepError,
    RequestAborted,
    RequestStream,
)
from ...engine.tokenizer_pool import PoolClosedError, ServerBusyError
from ...outputs import CompletionOutput, RequestOutput
from ..http.errors import APIError, from_value_error

SSE_DONE = b"data: [DONE]\n\n"
logger = logging.getLogger("replayllm.server")

Receive = Callable[[], Awaitable[dict]]
# A streamed call's renderer: the SSE bytes of one (prompt index, newest output), b"" when nothing is new.
Render = Callable[[int, RequestOutput], bytes]


def sse(chunk: BaseModel | dict) -> bytes:
    """One SSE event of a model or a dict (error events, chunks off the per-token path)."""
    if isinstance(chunk, BaseModel):
        return b"data: " + chunk.model_dump_json().encode() + b"\n\n"
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


def engine_error(e: BaseException, fields, aliases: dict[str, str] | None = None) -> APIError:
    """Map what adding/running a request can raise to an APIError (client errors -> 400)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, NotImplementedError)):
        return from_value_error(e, fields, aliases)
    if isinstance(e, ServerBusyError):  # the tokenizer pool's large lane is full
        return APIError(503, str(e), code="server_busy", headers={"Retry-After": "1"})
    if isinstance(e, EngineAsleepError):  # the request is fine; the engine is not serving until POST /wake_up
        return APIError(503, "the engine is asleep (sleep mode): POST /wake_up before sending requests",
                        code="engine_asleep")
    if isinstance(e, (EngineDeadError, PoolClosedError)):
        return APIError(503, f"the engine is not running: {e}", code="engine_unavailable")
    # 500s never carry an exception's text (it may quote internals or the input): the server log has it.
    if isinstance(e, EngineStepError):
        return APIError(500, "an engine step failed; the requests in it were stopped (details in the server log)",
                        code="engine_step_failed")
    if isinstance(e, RequestAborted):
        return APIError(500, str(e), code="aborted")
    logger.error("internal error handling a request", exc_info=e)
    return APIError(500, f"internal server error ({type(e).__name__}; details in the server log)")


async def _watch_disconnect(receive: Receive, stream: RequestStream) -> None:
    """Wait for the client to go away (the body is already read, so `receive` only returns at disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            stream.fail(ClientDisconnected("the client disconnected"))
            return


@contextlib.asynccontextmanager
async def disconnect_watcher(receive: Receive, stream: RequestStream):
    task = asyncio.create_task(_watch_disconnect(receive, stream))
    try:
        yield
    finally:
        task.cancel()


async def collect_final(stream: RequestStream, receive: Receive) -> dict[int, RequestOutput]:
    """Wait for every prompt's final output; a client disconnect aborts them (ClientDisconnected)."""
    finals: dict[int, RequestOutput] = {}
    async with disconnect_watcher(receive, stream):
        async for index, out in stream.outputs():
            if out.finished:
                finals[index] = out
    return finals


async def final_outputs(stream: RequestStream, receive: Receive,
                        to_error: Callable[[BaseException], APIError]) -> dict[int, RequestOutput]:
    """collect_final for a route's non-streamed answer: a client that left raises ClientDisconnected (the route
    counts it as 499); any other failure becomes the route's APIError (`to_error`)."""
    try:
        return await collect_final(stream, receive)
    except ClientDisconnected:
        raise
    except Exception as e:
        raise to_error(e) from e


class SSEBody:
    """The SSE body of one call. `close()` aborts the call's requests (a no-op once they finished); the
    server calls it when the response ends for any reason, even when the body was never iterated (a client
    gone before the first chunk), where the generator's own `finally` would never run. `render`: the renderer
    the chunks come from (one delta state), with which a response may write an unfinished output's chunk at
    delivery instead of waking the reader (sse_response.direct_sink, RequestStream.sink)."""

    def __init__(self, chunks: AsyncIterator[bytes], stream: RequestStream, render: Render | None = None):
        self._chunks = chunks
        self.stream = stream
        self.render = render

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks.__aiter__()

    def close(self) -> None:
        self.stream.abort()


def guard_sse(chunks: AsyncIterator[bytes], stream: RequestStream, receive: Receive, fields,
              render: Render | None = None) -> SSEBody:
    return SSEBody(_framed_sse(chunks, stream, receive, fields), stream, render)


async def _framed_sse(chunks: AsyncIterator[bytes], stream: RequestStream, receive: Receive,
                      fields) -> AsyncIterator[bytes]:
    """Frame a chunk generator for StreamingResponse: watch for disconnects (abort), turn errors raised
    mid-stream into an error event (the status line is already sent), and end with [DONE]."""
    try:
        async with disconnect_watcher(receive, stream):
            async for chunk in chunks:
                yield chunk
    except ClientDisconnected:
        return
    except Exception as e:  # noqa: BLE001 - reported to the client in-band
        yield sse(engine_error(e, fields).body())
    finally:
        stream.abort()  # no-op when everything finished
    yield SSE_DONE


@dataclass
class DeltaTracker:
    """What one choice has already streamed. Text that could still be cut by a stop string (its last
    `max stop length - 1` characters) is held back until the choice finishes, so the streamed pieces always
    concatenate to the final text."""

    hold: int = 0
    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    done: bool = False
    offset: int = 0  # logprobs text_offset of the next token

    def advance(self, comp: CompletionOutput) -> tuple[str, slice]:
        """(new text, slice of the new tokens) since the last call."""
        end = len(comp.text) if comp.finished() else max(self.text_sent, len(comp.text) - self.hold)
        text = comp.text[self.text_sent:end]
        self.text_sent = end
        tokens = slice(self.tokens_sent, len(comp.token_ids))
        self.tokens_sent = len(comp.token_ids)
        return text, tokens


def stop_hold(stop: str | list[str] | None) -> int:
    if not stop:
        return 0
    stops = [stop] if isinstance(stop, str) else stop
    return max(len(s) for s in stops) - 1
