"""POST /v1/completions: prompts (text or token ids) -> engine requests -> OpenAI completion JSON or SSE."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ...engine.protocol import PromptProcessor
from ...engine.request_stream import RequestStream
from ...outputs import CompletionOutput, RequestOutput
from ...sampling_params import SamplingParams
from ...trace_rules import EchoCombination, TraceConflict, check_options
from ..http.errors import bad_request
from ..http.limits import check_prompts, check_sampling
from .input_check import check_prompt_ids, check_text
from .openai_protocol import CompletionRequest
from .openai_responses import (
    CompletionChoice,
    CompletionResponse,
    UsageInfo,
    completion_logprobs,
    render_prompt_logprobs,
    routed_experts_json,
)
from .serving_base import ServingBase
from .serving_beam_search import check_beam_request, finals_of, run_beam_search
from .stream_chunks import ChunkFrame, usage_dict
from .streaming import DeltaTracker, engine_error, final_outputs, guard_sse, stop_hold

FIELDS = tuple(CompletionRequest.model_fields)


@dataclass
class PreparedPrompt:
    """A prompt after tokenization (on the engine thread); text and token texts only when echo needs them."""

    text: str | None
    token_ids: list[int]
    token_texts: list[str] | None = None  # per prompt token (echo with logprobs)

    def engine_prompt(self, cache_salt: str | None = None) -> dict:
        prompt = {"prompt_token_ids": self.token_ids, "prompt": self.text}
        return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}


def _prepare(engine: PromptProcessor, prompt: str | list[int], add_special_tokens: bool, echo: bool,
             want_texts: bool, truncate: int | None = None) -> PreparedPrompt:
    """Tokenize and check one prompt (LLMEngine.process_prompt, the same check as `LLM.generate`); `truncate`:
    truncate_prompt_tokens (an echo then shows the prompt the model saw)."""
    text, ids = engine.process_prompt(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt},
                                      add_special_tokens, truncate)
    if (text is None or truncate is not None) and echo and engine.tokenizer is not None:
        text = engine.tokenizer.decode(ids)
    texts = [engine.decode_token(t) or "" for t in ids] if want_texts else None
    return PreparedPrompt(text, ids, texts)


class CompletionServer(ServingBase):
    """POST /v1/completions over the engine client (ServingBase: names, limits, the first checks, queueing)."""

    async def create(self, req: CompletionRequest, receive) -> CompletionResponse | AsyncIterator[bytes]:
        """The response model, or (stream=true) an SSE chunk iterator. Client errors raise APIError before
        anything is queued."""
        self.admit(req)
        req.check()
        prompts = req.prompts()
        check_sampling(req, self.limits, len(prompts))
        chars = check_prompts(prompts, self.limits, req.truncate_prompt_tokens is not None)
        check_text(req)
        check_prompt_ids(prompts)
        if req.use_beam_search:
            return await self._beam_search(req, prompts, chars, receive)
        want_logprobs = req.logprobs is not None
        echo = bool(req.echo)
        prompt_logprobs = req.prompt_logprobs
        if echo and want_logprobs:
            _check_echo_with_trace(req, "echo_logprobs")
            prompt_logprobs = -1 if -1 in (prompt_logprobs, req.logprobs) else max(prompt_logprobs or 0,
                                                                                    req.logprobs)  # -1: all
        prompt_only = _prompt_only(req)
        add_special = req.add_special_tokens is not False
        try:
            # Prompt only: the engine generates one token (the prompt's forward is what scores it), not shown.
            params = req.to_sampling_params(max_tokens=1 if prompt_only else req.max_tokens, logprobs=req.logprobs,
                                            prompt_logprobs=prompt_logprobs, defaults=self.default_sampling)
            if not echo and all(isinstance(p, list) for p in prompts):  # token ids: nothing to tokenize or
                prepared = [PreparedPrompt(None, p) for p in prompts]  # decode (add_requests checks the ids)
            else:
                prepared = await self.engine.run_tokenizer(
                    lambda e: [_prepare(e, p, add_special, echo, echo and want_logprobs, params.truncate_prompt_tokens)
                               for p in prompts],
                    size=chars)
            self.check_room(req.max_tokens, params, [len(p.token_ids) for p in prepared])
            request_id, stream = await self.queue("cmpl", [p.engine_prompt(req.cache_salt) for p in prepared], params,
                                                  [len(p.token_ids) for p in prepared], bool(req.stream),
                                                  req.request_id)
        except Exception as e:
            raise engine_error(e, FIELDS) from e
        render = _Renderer(req, request_id, self.model_name, prepared, params.n, prompt_only)
        if req.stream:
            return guard_sse(render.chunks(stream), stream, receive, FIELDS, render.render)
        finals = await final_outputs(stream, receive, lambda e: engine_error(e, FIELDS))
        return render.response(finals)

    async def _beam_search(self, req: CompletionRequest, prompts: list, chars: int, receive) -> CompletionResponse:
        """use_beam_search (serving_beam_search.py): the prompts tokenized as any request's, then the search."""
        check_beam_request(req)
        add_special = req.add_special_tokens is not False
        try:
            # truncate_prompt_tokens checked as any request's (SamplingParams: 0 and < -1 are 400s)
            truncate = SamplingParams(truncate_prompt_tokens=req.truncate_prompt_tokens).truncate_prompt_tokens
            prepared = await self.engine.run_tokenizer(
                lambda e: [_prepare(e, p, add_special, False, False, truncate) for p in prompts], size=chars)
        except Exception as e:
            raise engine_error(e, FIELDS) from e
        ids = [p.token_ids for p in prepared]
        results, width = await run_beam_search(self, req, ids, req.max_tokens, req.logprobs, receive,
                                               lambda e: engine_error(e, FIELDS), "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        render = _Renderer(req, request_id, self.model_name, prepared, width)
        return render.response(finals_of(results, ids, req.logprobs, request_id))


class _Renderer:
    """Turns RequestOutputs into OpenAI completion choices (whole, or as streamed deltas: `render` keeps what
    each choice has streamed, so the reader task and the direct writer (SSEBody.render) share one state)."""

    def __init__(self, req: CompletionRequest, request_id: str, model: str, prepared: list[PreparedPrompt],
                 n: int, prompt_only: bool = False):
        self.req, self.id, self.model, self.prepared, self.n = req, request_id, model, prepared, n
        self.prompt_only = prompt_only  # echo with max_tokens 0: the engine's one token is not shown
        self.as_ids = bool(req.return_tokens_as_token_ids)
        self.token_ids = bool(req.return_token_ids)
        if req.stream:
            self.frame = ChunkFrame(request_id, "text_completion", model)
            self.hold = stop_hold(req.stop)
            self.continuous_usage, self.echo_any = req.continuous_usage, bool(req.echo)
            self.trackers: dict[tuple[int, int], DeltaTracker] = {}
            self.finals: dict[int, RequestOutput] = {}

    def _logprobs(self, i: int, out: RequestOutput, comp: CompletionOutput, tokens: slice, offset: int,
                  echo: bool) -> tuple[dict | None, int]:
        """Logprobs of comp's `tokens` (preceded by the prompt's when echoing), and the offset after them."""
        if self.req.logprobs is None:
            return None, offset
        lp = None
        if echo:  # the prompt's logprobs (requested from the engine for this) come first
            lp, offset = completion_logprobs(out.prompt_token_ids, out.prompt_logprobs, offset, self.as_ids,
                                             texts=self.prepared[i].token_texts)
        gen, offset = completion_logprobs(comp.token_ids[tokens], comp.logprobs[tokens], offset, self.as_ids)
        if lp is None:
            return gen, offset
        for name, values in gen.items():
            lp[name].extend(values)
        return lp, offset

    def _choice(self, i: int, out: RequestOutput, comp: CompletionOutput, text: str, logprobs: dict | None,
                tokens: slice, finished: bool, with_prompt_ids: bool) -> dict:
        """CompletionChoice's fields, in its order (a dict: streamed chunks encode it directly); routed_experts
        only on a finished choice that has them (--enable-return-routed-experts)."""
        choice = {
            "index": i * self.n + comp.index, "text": text, "logprobs": logprobs,
            "finish_reason": comp.finish_reason if finished else None,
            "stop_reason": comp.stop_reason if finished else None,
            "prompt_logprobs": render_prompt_logprobs(out.prompt_logprobs)
            if self.req.prompt_logprobs is not None and finished else None,
            "prompt_token_ids": out.prompt_token_ids if self.token_ids and with_prompt_ids else None,
            "token_ids": comp.token_ids[tokens] if self.token_ids else None}
        if finished and comp.routed_experts is not None:
            choice["routed_experts"] = routed_experts_json(comp.routed_experts)
        return choice

    def response(self, finals: dict[int, RequestOutput]) -> CompletionResponse:
        choices = []
        for i in sorted(finals):
            out = self._shown(finals[i])
            echo_text = (self.prepared[i].text or "") if self.req.echo else ""
            for comp in out.outputs:
                lp, _ = self._logprobs(i, out, comp, slice(None), 0, bool(self.req.echo))
                choices.append(CompletionChoice(**self._choice(i, out, comp, echo_text + comp.text, lp,
                                                               slice(None), True, True)))
        return CompletionResponse(id=self.id, model=self.model, choices=choices,
                                  usage=_usage({i: self._shown(out) for i, out in finals.items()}))

    async def chunks(self, stream: RequestStream) -> AsyncIterator[bytes]:
        """One SSE event per choice that has something new, all of one wakeup in one write (several steps'
        tokens when the client read slower than the engine stepped: the stream keeps only the newest output)."""
        async for i, out in stream.outputs():
            data = self.render(i, out)
            if data:
                yield data
        if self.req.include_usage:
            yield self.frame.event({"choices": [], "usage": _usage(self.finals).model_dump(),
                                    "system_fingerprint": None})

    def render(self, i: int, out: RequestOutput) -> bytes:
        """The events of prompt i's newest output: one per choice with something new (b"" if none)."""
        out = self._shown(out)
        if out.finished:
            self.finals[i] = out
        events = []
        for comp in out.outputs:
            tr = self.trackers.get((i, comp.index))
            if tr is None:
                tr = self.trackers[(i, comp.index)] = DeltaTracker(self.hold)
            if tr.done:
                continue
            echo = self.echo_any and not tr.started
            text, tokens = tr.advance(comp)
            if echo:
                text = (self.prepared[i].text or "") + text
            tr.done = comp.finished()
            if not text and tokens.start == tokens.stop and not tr.done:
                continue
            lp, tr.offset = self._logprobs(i, out, comp, tokens, tr.offset, echo)
            choice = self._choice(i, out, comp, text, lp, tokens, tr.done, not tr.started)
            tr.started = True
            usage = usage_dict(len(out.prompt_token_ids), len(comp.token_ids)) if self.continuous_usage else None
            events.append(self.frame.event({"choices": [choice], "usage": usage, "system_fingerprint": None}))
        return b"".join(events)


    def _shown(self, out: RequestOutput) -> RequestOutput:
        """`out` as the client sees it: for a prompt-only request, choices with no generated token, finished by
        "length" (max_tokens 0) once the engine's request is."""
        if not self.prompt_only:
            return out
        return dataclasses.replace(out, outputs=[dataclasses.replace(
            c, text="", token_ids=[], cumulative_logprob=0.0 if c.cumulative_logprob is not None else None,
            logprobs=[] if c.logprobs is not None else None, full_logprobs=None, stop_reason=None,
            finish_reason="length" if c.finished() else None) for c in out.outputs])


def _prompt_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0 (vLLM's and the legacy OpenAI API's prompt scoring): the prompt echoed, with its
    logprobs when `logprobs` is set, and nothing generated. Not with a trace (a trace is generated tokens) nor a
    min_tokens above 0."""
    if not req.echo or req.max_tokens != 0:
        return False
    _check_echo_with_trace(req, "echo_prompt_only")
    if req.min_tokens:
        raise bad_request(f"min_tokens must be 0 with max_tokens 0 (got {req.min_tokens})", "min_tokens")
    return True


def _check_echo_with_trace(req: CompletionRequest, combination: EchoCombination) -> None:
    """An `echo` combination against the request's trace, by the trace rules; a 400 naming the field at fault."""
    if req.trace_decode_token_ids is None:
        return
    try:
        check_options({combination: True})
    except TraceConflict as e:
        raise bad_request(str(e), e.option) from None


def _usage(finals: dict[int, RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per prompt; completion tokens over every choice."""
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in finals.values()),
                        sum(len(c.token_ids) for o in finals.values() for c in o.outputs))
