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
from .reasoning_parser import ReasoningParser
from .request_fields import apply_field_policy
from .responses_bodies import (
    EventWriter,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
    Status,
    finished_status,
)
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
        reasoning = await self.chat.reasoning_parser()  # --reasoning-parser: a reasoning item before the message
        chat_req = req.chat_request(history)
        if reasoning is not None and reasoning.tags_special and chat_req.skip_special_tokens is None:
            chat_req.skip_special_tokens = False  # the <think> tags stay in the text the parser splits (as chat)
        try:
            request_id, stream, params, _ = await self.chat.submit(chat_req, "resp", fit_max_tokens=True)
        except APIError as e:
            if e.param in CHAT_TO_RESPONSES:  # a chat field's error is about the Responses field it came from
                e.param = CHAT_TO_RESPONSES[e.param]
            raise
        run = _Run(req, request_id, self.chat.model_name, params, history + req.input_messages(), self.store,
                   reasoning)
        if req.stream:
            return SSEBody(_framed(run, stream, receive), stream)
        finals = await final_outputs(stream, receive, lambda e: engine_error(e, FIELDS))
        return run.finish(finals[0])


class _Run:
    """One response: its ids and settings, the object built from the engine's output, the streamed events."""

    def __init__(self, req: ResponsesRequest, request_id: str, model: str, params: SamplingParams,
                 conversation: list[ChatMessage], store: ResponseStore, reasoning: ReasoningParser | None = None):
        self.req, self.model, self.params, self.conversation, self.store = req, model, params, conversation, store
        self.reasoning = reasoning
        self.id = "resp_" + request_id.partition("-")[2]
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.writer = EventWriter()

    def _object(self, status, output: list[ReasoningItem | OutputMessage], usage: ResponseUsage | None = None,
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
        reasoning, content = None, comp.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(out.prompt_token_ids, comp.text)
        text = OutputText(text=content or "", logprobs=self.logprobs(comp, slice(None)))  # every token's logprobs
        output: list[ReasoningItem | OutputMessage] = [OutputMessage(id=self.message_id, status=status,
                                                                     content=[text])]
        if reasoning is not None:
            output.insert(0, self.reasoning_item(reasoning, "completed" if content is not None else status))
        usage = ResponseUsage.of(len(out.prompt_token_ids), len(comp.token_ids),
                                 self._reasoning_tokens(comp, reasoning))
        response = self._object(status, output, usage, incomplete)
        if response.store:
            answer = ChatMessage(role="assistant", content=content or "", reasoning_content=reasoning)
            self.store.put(StoredResponse(response, (*self.conversation, answer)))
        return response

    def reasoning_item(self, text: str, status: Status) -> ReasoningItem:
        return ReasoningItem(id=self.reasoning_id, content=[ReasoningText(text=text)], status=status)

    def _reasoning_tokens(self, comp: CompletionOutput, reasoning: str | None) -> int:
        """Output tokens up to and including the span's </think> (all of them when it never closed)."""
        tokens = self.reasoning.tokens if self.reasoning is not None else None
        if reasoning is None:
            return 0
        if tokens is not None and tokens.end_token_id in comp.token_ids:
            return comp.token_ids.index(tokens.end_token_id) + 1
        return len(comp.token_ids)

    async def events(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """OpenAI's event sequence (vLLM's too: response.completed also closes an incomplete response, whose
        `status` says so): with --reasoning-parser a reasoning item (reasoning_text deltas) first, then the
        message; a token's logprobs travel with the next output_text delta."""
        ev = self.writer.event
        start = self._object("in_progress", []).model_dump(mode="json")
        yield ev("response.created", response=start) + ev("response.in_progress", response=start)
        items = _StreamItems(self)
        tracker, final, splitter, pending = DeltaTracker(stop_hold(self.req.stop)), None, None, []
        async for _, out in stream.outputs():
            comp = out.outputs[0]
            delta, tokens = tracker.advance(comp)
            pending += self.logprobs(comp, tokens) or []
            reasoning, content = "", delta
            if self.reasoning is not None:
                splitter = splitter or self.reasoning.splitter(out.prompt_token_ids)
                reasoning, content = splitter.feed(delta)
                if out.finished:
                    held_reasoning, held_content = splitter.flush()
                    reasoning, content = reasoning + held_reasoning, content + held_content
            chunk = items.reasoning(reasoning) if splitter is not None and splitter.saw_reasoning else b""
            if content or (pending and not items.reasoning_open):
                chunk += items.text(content, pending)
                pending = []
            if out.finished:
                final = out
            if chunk:
                yield chunk
        if final is None:
            raise RuntimeError("the request's stream ended before its output finished")
        response = self.finish(final)
        yield items.close(response, pending)


class _StreamItems:
    """The output items of a streamed response as they open and close: the reasoning item (index 0, when the
    output has a reasoning span), then the message."""

    def __init__(self, run: _Run):
        self.run, self.ev = run, run.writer.event
        self.reasoning_text: str | None = None  # None: no reasoning item opened
        self.reasoning_open = False
        self.message_index: int | None = None  # None: the message item not opened yet

    def _where(self, item_id: str, index: int) -> dict:
        return {"item_id": item_id, "output_index": index, "content_index": 0}

    def reasoning(self, text: str) -> bytes:
        out = b""
        if self.reasoning_text is None:
            self.reasoning_text, self.reasoning_open = "", True
            item = self.run.reasoning_item("", "in_progress").model_copy(update={"content": []})
            out += self.ev("response.output_item.added", output_index=0, item=item.model_dump(mode="json"))
        if text:
            self.reasoning_text += text
            out += self.ev("response.reasoning_text.delta", **self._where(self.run.reasoning_id, 0), delta=text)
        return out

    def _close_reasoning(self, status: Status) -> bytes:
        if not self.reasoning_open:
            return b""
        self.reasoning_open = False
        item = self.run.reasoning_item(self.reasoning_text, status).model_dump(mode="json")
        return (self.ev("response.reasoning_text.done", **self._where(self.run.reasoning_id, 0),
                        text=self.reasoning_text)
                + self.ev("response.output_item.done", output_index=0, item=item))

    def _open_message(self) -> bytes:
        if self.message_index is not None:
            return b""
        out = self._close_reasoning("completed")
        self.message_index = 0 if self.reasoning_text is None else 1
        item = OutputMessage(id=self.run.message_id, status="in_progress", content=[])
        empty = OutputText(text="", logprobs=[] if self.run.req.wants_logprobs else None)
        return (out + self.ev("response.output_item.added", output_index=self.message_index,
                              item=item.model_dump(mode="json"))
                + self.ev("response.content_part.added", **self._where(self.run.message_id, self.message_index),
                          part=empty.model_dump(mode="json")))

    def text(self, delta: str, logprobs: list[dict]) -> bytes:
        out = self._open_message()
        return out + self.ev("response.output_text.delta", **self._where(self.run.message_id, self.message_index),
                             delta=delta, logprobs=logprobs)

    def close(self, response: ResponseObject, pending: list[dict]) -> bytes:
        """The last events: the reasoning item closed with the response's status when nothing followed it, the
        message (opened now if it had no text), held logprobs, the done events, response.completed."""
        out = self._close_reasoning(response.output[0].status if len(response.output) > 1 else "completed")
        out += self._open_message()
        if pending:
            out += self.text("", pending)
        message = response.output[-1]
        part = message.content[0].model_dump(mode="json")
        where = self._where(self.run.message_id, self.message_index)
        return (out + self.ev("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"] or [])
                + self.ev("response.content_part.done", **where, part=part)
                + self.ev("response.output_item.done", output_index=self.message_index,
                          item=message.model_dump(mode="json"))
                + self.ev("response.completed", response=response.model_dump(mode="json")))


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
