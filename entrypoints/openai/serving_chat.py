"""POST /v1/chat/completions: messages -> chat template -> one engine request -> OpenAI chat JSON or SSE."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from ...engine.protocol import EngineClient, PromptProcessor
from ...engine.request_stream import RequestStream
from ...outputs import CompletionOutput, RequestOutput
from ...sampling_params import SamplingParams
from ..chat_template import check_chat_template_kwargs, messages_for_template, template_source
from ..http.limits import RequestLimits, check_messages, check_sampling
from .input_check import check_text
from .openai_protocol import ChatCompletionRequest
from .openai_responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    UsageInfo,
    chat_logprobs,
    render_prompt_logprobs,
    routed_experts_json,
)
from .reasoning_parser import ReasoningParser, StreamedReasoning, message_fields
from .request_fields import dropped_template_kwargs
from .serving_base import ServingBase
from .serving_beam_search import check_beam_request, finals_of, run_beam_search
from .stream_chunks import ChunkFrame, usage_dict
from .streaming import DeltaTracker, engine_error, final_outputs, guard_sse, stop_hold
from .tool_calling import ChoiceTools, ToolPlan, ToolServing, check_tool_schemas, plan_tools

FIELDS = tuple(ChatCompletionRequest.model_fields)
ALIASES = {"prompt": "messages"}  # engine messages about the (rendered) prompt are about the messages


def render_chat(engine: PromptProcessor, conversation: list[dict], add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool,
                chat_template_kwargs: dict | None = None, chat_template: str | None = None,
                dropped: list[str] | None = None, tools: list[dict] | None = None) -> list[int]:
    """Apply the chat template (`chat_template`, else the tokenizer's) and tokenize (on the tokenizer pool).
    Same ids as LLM.chat. `dropped`: a list to get the chat_template_kwargs keys the template does not read,
    left out (None: they are a ValueError). `tools`: the tool definitions for the template (None: none)."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("chat needs a tokenizer; this server was started with --skip-tokenizer-init")
    if chat_template is None and not getattr(tok, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions or start the server "
                         "with --chat-template")
    extra = check_chat_template_kwargs(tok, chat_template_kwargs, chat_template, drop_unused=dropped is not None)
    if dropped is not None:
        dropped.extend(k for k in chat_template_kwargs or {} if k not in extra)
    if tools:
        extra["tools"] = tools
    conversation = messages_for_template(conversation, template_source(tok, chat_template))
    try:
        text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, chat_template=chat_template,
                                       **extra)
    except Exception as e:  # a template that rejects these messages (role order, ...) is the client's error
        raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
    return engine.tokenize(text, add_special_tokens)


class ChatServer(ServingBase):
    """POST /v1/chat/completions (and, through `submit`, the Responses API) over the engine client."""

    def __init__(self, engine: EngineClient, model_name: str | tuple[str, ...], limits: RequestLimits,
                 default_sampling: dict | None = None, chat_template: str | None = None,
                 strict_fields: bool = False, reasoning_parser: str | None = None,
                 tools: ToolServing | None = None):
        super().__init__(engine, model_name, limits, default_sampling, strict_fields)
        self.tools = tools or ToolServing()  # --enable-auto-tool-choice, --tool-call-parser (tool_calling.py)
        self.reasoning_parser_name = reasoning_parser  # --reasoning-parser
        self._reasoning: ReasoningParser | None = None  # resolved on first use (the tokenizer's think ids)
        self.chat_template = chat_template  # --chat-template (None: the tokenizer's)

    async def create(self, req: ChatCompletionRequest, receive) -> ChatCompletionResponse | AsyncIterator[bytes]:
        reasoning = await self.reasoning_parser()  # before the request is queued: nothing to clean up if it fails
        if req.use_beam_search:  # its text is decoded whole (special tokens kept): no skip_special_tokens to set
            return await self._beam_search(req, receive, reasoning)
        if reasoning is not None and reasoning.tags_special and req.skip_special_tokens is None:
            req.skip_special_tokens = False  # the <think> tags stay in the text the parser splits
        request_id, stream, params, prompt_len = await self.submit(req, "chatcmpl")
        tool_plan = plan_tools(req, self.tools)  # checked by submit already: its parser, fresh
        render = _Renderer(req, request_id, self.model_name, params.n, reasoning, tool_plan, prompt_len)
        if req.stream:
            return guard_sse(render.chunks(stream), stream, receive, FIELDS, render.render)
        finals = await final_outputs(stream, receive, lambda e: engine_error(e, FIELDS))
        return render.response(finals[0])

    async def submit(self, req: ChatCompletionRequest, id_prefix: str, fit_max_tokens: bool = False
                     ) -> tuple[str, RequestStream, SamplingParams, int]:
        """Check the request, render its messages, queue it: (request id "{id_prefix}-<hex>", its stream, its
        params, the prompt's tokens). Client errors raise APIError before anything is queued. Also the Responses
        API's path (serving_responses.py builds a ChatCompletionRequest). `fit_max_tokens`: a max_tokens past the
        room the prompt leaves is cut to it (the Responses API's max_output_tokens, as vLLM's), else a 400."""
        chars = self._check(req)
        plan, constrained = self._tool_plan(req)
        try:
            params = constrained.to_sampling_params(max_tokens=req.new_tokens(), logprobs=req.shown_logprobs(),
                                                    prompt_logprobs=req.prompt_logprobs,
                                                    defaults=self.default_sampling)
            ids = await self._render(req, chars, plan.template_tools)
            if not fit_max_tokens:
                self.check_room(req.new_tokens(), params, [len(ids)])
            prompt = {"prompt_token_ids": ids} if req.cache_salt is None else {"prompt_token_ids": ids,
                                                                                "cache_salt": req.cache_salt}
            request_id, stream = await self.queue(id_prefix, [prompt], params, [len(ids)], bool(req.stream),
                                                  req.request_id)
        except Exception as e:  # the engine says "max_tokens"; the body may have said max_completion_tokens
            aliases = (ALIASES if req.max_completion_tokens is None
                       else {**ALIASES, "max_tokens": "max_completion_tokens"})
            raise engine_error(e, FIELDS, aliases) from e
        return request_id, stream, params, len(ids)

    def _check(self, req: ChatCompletionRequest) -> int:
        """The checks every chat body gets before anything is rendered; the messages' characters."""
        self.admit(req)
        req.check()
        check_sampling(req, self.limits, 1)
        chars = check_messages(req, self.limits)
        check_text(req)
        return chars

    async def _render(self, req: ChatCompletionRequest, chars: int, tools: list[dict] | None) -> list[int]:
        """The messages through the chat template and the tokenizer (on the tokenizer pool); template variables
        the template does not read are dropped and named (a 400 when strict)."""
        conversation, template_kwargs = req.conversation(), req.template_kwargs()
        dropped = None if self.strict_fields else []
        ids = await self.engine.run_tokenizer(lambda e: render_chat(
            e, conversation, bool(req.add_generation_prompt), bool(req.continue_final_message),
            bool(req.add_special_tokens), template_kwargs, self.chat_template, dropped, tools), size=chars)
        dropped_template_kwargs(req, req.template_kwarg_fields(dropped or []))
        return ids

    async def _beam_search(self, req: ChatCompletionRequest, receive, reasoning: ReasoningParser | None
                           ) -> ChatCompletionResponse:
        """use_beam_search (serving_beam_search.py): the messages rendered as any request's, then the search; the
        choices are the beams (their text through --reasoning-parser as any choice's)."""
        chars = self._check(req)
        check_beam_request(req)
        try:
            ids = await self._render(req, chars, None)
        except Exception as e:
            raise engine_error(e, FIELDS, ALIASES) from e
        logprobs = req.shown_logprobs()
        results, width = await run_beam_search(self, req, [ids], req.new_tokens(), logprobs, receive,
                                               lambda e: engine_error(e, FIELDS, ALIASES), "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        render = _Renderer(req, request_id, self.model_name, width, reasoning)
        return render.response(finals_of(results, [ids], logprobs, request_id)[0])

    def _tool_plan(self, req: ChatCompletionRequest) -> tuple[ToolPlan, ChatCompletionRequest]:
        """The request's tool handling, and the request to take sampling params from: with tool_choice
        "required" or a named function, one whose structured_outputs is the calls' constraint; with "auto", one
        that keeps special tokens in the text (tool_calling.py)."""
        plan = plan_tools(req, self.tools)
        overrides = plan.sampling_overrides()
        if not overrides:
            return plan, req
        check_tool_schemas(plan)
        return plan, req.model_copy(update=overrides)

    async def reasoning_parser(self) -> ReasoningParser | None:
        """--reasoning-parser with the tokenizer's think-token ids (resolved once, on the tokenizer's thread)."""
        if self.reasoning_parser_name is not None and self._reasoning is None:
            name = self.reasoning_parser_name
            self._reasoning = await self.engine.run_tokenizer(lambda e: ReasoningParser.load(name, e.tokenizer),
                                                              size=0)
        return self._reasoning


class _Renderer:
    """Turns a RequestOutput into chat choices (whole, or as streamed deltas: `render` keeps what each choice
    has streamed, so the reader task and the direct writer (SSEBody.render) share one state)."""

    def __init__(self, req: ChatCompletionRequest, request_id: str, model: str, n: int,
                 reasoning: ReasoningParser | None = None, tool_plan: ToolPlan | None = None, prompt_len: int = 0):
        self.req, self.id, self.model, self.n = req, request_id, model, n
        self.prompt_len = prompt_len  # the role chunk's usage (continuous usage), before any output
        # tool calls read from the content (None: tool_choice "none", or no tools)
        self.tools = ChoiceTools(tool_plan) if tool_plan is not None and tool_plan.parser is not None else None
        self.reasoning = reasoning  # --reasoning-parser: <think> text as reasoning_content
        self.streamed_reasoning = StreamedReasoning(reasoning)
        self.as_ids = bool(req.return_tokens_as_token_ids)
        self.token_ids = bool(req.return_token_ids)
        self.echo = req.echoed()  # echo: the last (assistant) message's content, before each choice's
        if req.stream:
            self.frame = ChunkFrame(request_id, "chat.completion.chunk", model)
            self.trackers = [DeltaTracker(stop_hold(req.stop)) for _ in range(n)]
            self.final: RequestOutput | None = None
            self.prompt_ids_sent = self.head_sent = False

    def _logprobs(self, comp: CompletionOutput, tokens: slice) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(comp.token_ids[tokens], comp.logprobs[tokens], self.req.top_logprobs or 0,
                             self.as_ids)

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            fields, finish = self._with_tool_calls(message_fields(self.reasoning, out.prompt_token_ids, c.text),
                                                   c.finish_reason)
            if self.echo:
                fields["content"] = self.echo + (fields.get("content") or "")
            choices.append(ChatChoice(index=c.index, message=ChatMessageOut(**fields),
                                      logprobs=self._logprobs(c, slice(None)), finish_reason=finish,
                                      stop_reason=c.stop_reason, token_ids=c.token_ids if self.token_ids else None,
                                      routed_experts=routed_experts_json(c.routed_experts)))
        return ChatCompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=_usage(out),
            prompt_token_ids=out.prompt_token_ids if self.token_ids else None,
            prompt_logprobs=render_prompt_logprobs(out.prompt_logprobs)
            if self.req.prompt_logprobs is not None else None)

    def _with_tool_calls(self, fields: dict, finish_reason: str | None) -> tuple[dict, str | None]:
        """A whole message's fields and finish reason with its tool calls read out (tool_calling.py)."""
        if self.tools is None:
            return fields, finish_reason
        fields, called = self.tools.message(fields)
        return fields, self.tools.finish_reason(finish_reason, called)

    async def chunks(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """The role first (with the first output: `head`), then one event per choice with something new, all of
        one wakeup in one write."""
        async for i, out in stream.outputs():
            data = self.render(i, out)
            if data:
                yield data
        if head := self.head():  # no output came
            yield head
        if self.req.include_usage and self.final is not None:
            yield self.frame.event({"choices": [], "usage": _usage(self.final).model_dump(), "prompt_token_ids": None})

    def head(self) -> bytes:
        """The role, one chunk per choice (as OpenAI and vLLM do; then the echoed content), with vLLM's usage when
        continuous; once (b"" after). Sent with the first output, as vLLM sends it (the reader's or the direct
        writer's render, whichever writes first): a client that times its first chunk (vLLM's `bench serve
        --backend openai-chat`) measures the time to the first token, not to the request's acceptance."""
        if self.head_sent:
            return b""
        self.head_sent = True
        usage = usage_dict(self.prompt_len, 0) if self.req.continuous_usage else None
        deltas = [{"role": "assistant", "content": ""}] + ([{"content": self.echo}] if self.echo else [])
        return b"".join(self.frame.event({"choices": [_stream_choice(index, delta)], "usage": usage,
                                          "prompt_token_ids": None}) for delta in deltas for index in range(self.n))

    def render(self, _: int, out: RequestOutput) -> bytes:
        """The events of the newest output: one per choice with something new (b"" if none), after the head."""
        self.final = out if out.finished else self.final
        events = [self.head()]
        for comp in out.outputs:
            tr = self.trackers[comp.index]
            if tr.done:
                continue
            text, tokens = tr.advance(comp)
            tr.done = comp.finished()
            if not text and tokens.start == tokens.stop and not tr.done:
                continue
            lp = self._logprobs(comp, tokens)
            delta = self.streamed_reasoning.delta(comp.index, out.prompt_token_ids, text, tr.done)
            finish = comp.finish_reason
            if self.tools is not None:
                delta = self.tools.delta(comp.index, delta, tr.done)
                finish = self.tools.finish_reason(finish, self.tools.called(comp.index))
                if not delta and not tr.done and lp is None and not self.token_ids:
                    continue  # text held back (a call may be starting) and nothing else to send
            choice = _stream_choice(comp.index, delta, None if lp is None else lp.model_dump(),
                                    finish if tr.done else None,
                                    comp.stop_reason if tr.done else None,
                                    comp.token_ids[tokens] if self.token_ids else None)
            if tr.done and comp.routed_experts is not None:  # the closing chunk (--enable-return-routed-experts)
                choice["routed_experts"] = routed_experts_json(comp.routed_experts)
            prompt_ids = None
            if self.token_ids and not self.prompt_ids_sent:
                prompt_ids, self.prompt_ids_sent = out.prompt_token_ids, True
            usage = usage_dict(len(out.prompt_token_ids), len(comp.token_ids)) if self.req.continuous_usage else None
            events.append(self.frame.event({"choices": [choice], "usage": usage, "prompt_token_ids": prompt_ids}))
        return b"".join(events)


def _stream_choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
                   stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict:
    """ChatStreamChoice's fields, in its order; `delta` holds only the keys it sets (OpenAI's deltas)."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids}


def _usage(out: RequestOutput) -> UsageInfo:
    return UsageInfo.of(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
