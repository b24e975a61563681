"""POST /v1/responses, GET /v1/responses/{id}: OpenAI's Responses API (text) on the chat pipeline.

A request becomes a ChatCompletionRequest (responses_protocol.chat_request: instructions, the previous
response's conversation, the input), is checked, rendered and queued by ChatServer.submit, and its one output
is mapped to a `response` object (or its SSE events). Stored responses (store, default true) live in a
ResponseStore, for GET and for `previous_response_id`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from ...engine.request_stream import ClientDisconnected, RequestStream
from ...outputs import CompletionOutput, RequestOutput
from ...sampling_params import SamplingParams
from ..http.errors import APIError
from .chat_messages import ChatMessage
from .openai_responses import chat_logprobs
from .request_fields import apply_field_policy
from .responses_bodies import EventWriter, OutputMessage, OutputText, ResponseObject, ResponseUsage, finished_status
from .responses_protocol import CHAT_TO_RESPONSES, ResponsesRequest
from .responses_store import ResponseStore, StoredResponse
from .serving_chat import ChatServer
from .streaming import DeltaTracker, Receive, SSEBody, disconnect_watcher, engine_error, final_outputs, stop_hold

FIELDS = tuple(ResponsesRequest.model_fields)


class ResponsesServer:
    def __init__(self, chat: ChatServer, store: ResponseStore):
        self.chat = chat
        self.store = store

    def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id, "response_id").response

    async def create(self, req: ResponsesRequest, receive: Receive) -> ResponseObject | SSEBody:
        apply_field_policy(req, self.chat.strict_fields)  # unknown fields, nested too: ignored and named, or 400s
        req.check()
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            history = list(self.store.get(req.previous_response_id, "previous_response_id").messages)
        try:
            request_id, stream, params, _ = await self.chat.submit(req.chat_request(history), "resp",
                                                                   fit_max_tokens=True)
        except APIError as e:
            if e.param in CHAT_TO_RESPONSES:  # a chat field's error is about the Responses field it came from
                e.param = CHAT_TO_RESPONSES[e.param]
            raise
        run = _Run(req, request_id, self.chat.model_name, params, history + req.input_messages(), self.store)
        if req.stream:
            return SSEBody(_framed(run, stream, receive), stream)
        finals = await final_outputs(stream, receive, lambda e: engine_error(e, FIELDS))
        return run.finish(finals[0])


class _Run:
    """One response: its ids and settings, the object built from the engine's output, the streamed events."""

    def __init__(self, req: ResponsesRequest, request_id: str, model: str, params: SamplingParams,
                 conversation: list[ChatMessage], store: ResponseStore):
        self.req, self.model, self.params, self.conversation, self.store = req, model, params, conversation, store
        self.id = "resp_" + request_id.partition("-")[2]
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.writer = EventWriter()

    def _object(self, status, output: list[OutputMessage], usage: ResponseUsage | None = None,
                incomplete=None) -> ResponseObject:
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, incomplete_details=incomplete,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            model=self.model, output=output, previous_response_id=req.previous_response_id,
            parallel_tool_calls=req.parallel_tool_calls is not False, store=req.store is not False,
            temperature=self.params.temperature, top_p=self.params.top_p, top_logprobs=req.top_logprobs,
            tool_choice=req.tool_choice or "auto", usage=usage, user=req.user)

    def logprobs(self, comp: CompletionOutput, tokens: slice) -> list[dict] | None:
        """Chat's logprob entries of comp's `tokens` (None unless include asks for them)."""
        if not self.req.wants_logprobs:
            return None
        content = chat_logprobs(comp.token_ids[tokens], comp.logprobs[tokens], self.req.top_logprobs or 0,
                                bool(self.req.return_tokens_as_token_ids)).content
        return [entry.model_dump() for entry in content]

    def finish(self, out: RequestOutput) -> ResponseObject:
        """The finished response (stored when `store` is not false)."""
        comp = out.outputs[0]
        status, incomplete = finished_status(comp)
        text = OutputText(text=comp.text, logprobs=self.logprobs(comp, slice(None)))
        message = OutputMessage(id=self.message_id, status=status, content=[text])
        response = self._object(status, [message], ResponseUsage.of(len(out.prompt_token_ids), len(comp.token_ids)),
                                incomplete)
        if response.store:
            answer = ChatMessage(role="assistant", content=comp.text)
            self.store.put(StoredResponse(response, (*self.conversation, answer)))
        return response

    async def events(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """OpenAI's event sequence for one text message (vLLM's too: response.completed also closes an
        incomplete response, whose `status` says so)."""
        ev, where = self.writer.event, {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        start = self._object("in_progress", []).model_dump(mode="json")
        yield ev("response.created", response=start) + ev("response.in_progress", response=start)
        item = OutputMessage(id=self.message_id, status="in_progress", content=[])
        empty = OutputText(text="", logprobs=[] if self.req.wants_logprobs else None)
        yield (ev("response.output_item.added", output_index=0, item=item.model_dump(mode="json"))
               + ev("response.content_part.added", **where, part=empty.model_dump(mode="json")))
        tracker, final = DeltaTracker(stop_hold(self.req.stop)), None
        async for _, out in stream.outputs():
            comp = out.outputs[0]
            delta, tokens = tracker.advance(comp)
            logprobs = self.logprobs(comp, tokens) or []
            if delta or logprobs:
                yield ev("response.output_text.delta", **where, delta=delta, logprobs=logprobs)
            if out.finished:
                final = out
        if final is None:
            raise RuntimeError("the request's stream ended before its output finished")
        response = self.finish(final)
        message = response.output[0]
        part = message.content[0].model_dump(mode="json")
        yield (ev("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"] or [])
               + ev("response.content_part.done", **where, part=part)
               + ev("response.output_item.done", output_index=0, item=message.model_dump(mode="json"))
               + ev("response.completed", response=response.model_dump(mode="json")))


async def _framed(run: _Run, stream: RequestStream, receive: Receive) -> AsyncIterator[bytes]:
    """run's events; a disconnect aborts the request; an error after the status line is an `error` event (as
    OpenAI's). No [DONE]: OpenAI's and vLLM's Responses streams end after response.completed."""
    try:
        async with disconnect_watcher(receive, stream):
            async for chunk in run.events(stream):
                yield chunk
    except ClientDisconnected:
        return
    except Exception as e:  # noqa: BLE001 - reported to the client in-band
        err = engine_error(e, FIELDS)
        yield run.writer.event("error", code=err.code, message=err.message, param=err.param)
    finally:
        stream.abort()  # no-op when it finished
