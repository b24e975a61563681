"""POST /inference/v1/generate: token ids in -> one engine request -> token ids, logprobs (+ routes) out."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator

import numpy as np

from ...engine.request_stream import RequestStream
from ...outputs import CompletionOutput, RequestOutput
from ..http.errors import APIError
from ..http.limits import check_prompts, check_sampling
from .generate_protocol import GenerateChoice, GenerateRequest, GenerateResponse, GenerateSamplingParams
from .input_check import check_text
from .openai_responses import ChatLogprobs, chat_logprobs, render_prompt_logprobs
from .serving_base import ServingBase
from .stream_chunks import usage_dict
from .streaming import engine_error, final_outputs, guard_sse, sse

SAMPLING = tuple(GenerateSamplingParams.model_fields)
FIELDS = (*tuple(GenerateRequest.model_fields), *SAMPLING)
ALIASES = {"prompt": "token_ids"}  # the engine's messages about the prompt are about token_ids


def _error(e: BaseException) -> APIError:
    """engine_error, with a SamplingParams field's error named `sampling_params.<field>`."""
    err = engine_error(e, FIELDS, ALIASES)
    if err.param is not None and err.param.split(".")[0] in SAMPLING:
        err.param = f"sampling_params.{err.param}"
    elif err.param in ALIASES:  # limits.check_prompts names the prompt
        err.param = ALIASES[err.param]
    return err


def routes_b64(routes: np.ndarray | None) -> str | None:
    """CompletionOutput.routed_experts as vLLM sends it: a base64 .npy (None without routes)."""
    if routes is None:
        return None
    buf = io.BytesIO()
    np.save(buf, routes)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class GenerateServer(ServingBase):
    """POST /inference/v1/generate over the engine client (unknown fields: the server's policy, as chat's)."""

    async def create(self, req: GenerateRequest, receive) -> GenerateResponse | AsyncIterator[bytes]:
        self.admit(req)
        req.check()
        try:
            check_sampling(req.sampling_params, self.limits, 1)
            check_prompts([req.token_ids], self.limits, req.sampling_params.truncate_prompt_tokens is not None)
            check_text(req.sampling_params)
        except APIError as e:
            raise _error(e) from None
        try:
            params = req.sampling_params.to_sampling_params(self.default_sampling)
            request_id, stream = await self.queue("generate", [{"prompt_token_ids": req.token_ids}], params,
                                                  [len(req.token_ids)], bool(req.stream))
        except Exception as e:
            raise _error(e) from e
        render = _Renderer(req, req.request_id or request_id)
        if req.stream:
            return guard_sse(render.chunks(stream), stream, receive, FIELDS, render.render)
        finals = await final_outputs(stream, receive, _error)
        return render.response(finals[0])


class _Renderer:
    """A RequestOutput as the response, or as stream chunks (only each choice's new tokens, as vLLM's DELTA)."""

    def __init__(self, req: GenerateRequest, request_id: str):
        self.req, self.id = req, request_id
        self.top_n = req.sampling_params.logprobs
        self.sent: dict[int, int] = {}  # choice index -> tokens streamed
        self.final: RequestOutput | None = None

    def _logprobs(self, comp: CompletionOutput, tokens: slice) -> ChatLogprobs | None:
        if self.top_n is None:
            return None
        return chat_logprobs(comp.token_ids[tokens], comp.logprobs[tokens], self.top_n, True)

    def response(self, out: RequestOutput) -> GenerateResponse:
        choices = [GenerateChoice(index=c.index, token_ids=c.token_ids, logprobs=self._logprobs(c, slice(None)),
                                  finish_reason=c.finish_reason, routed_experts=routes_b64(c.routed_experts))
                   for c in out.outputs]
        prompt_logprobs = (render_prompt_logprobs(out.prompt_logprobs)
                           if self.req.sampling_params.prompt_logprobs is not None else None)
        return GenerateResponse(request_id=self.id, choices=choices, prompt_logprobs=prompt_logprobs)

    async def chunks(self, stream: RequestStream) -> AsyncIterator[bytes]:
        async for i, out in stream.outputs():
            data = self.render(i, out)
            if data:
                yield data
        opts = self.req.stream_options
        if opts is not None and opts.include_usage and self.final is not None:
            out = self.final
            usage = usage_dict(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
            yield sse({"request_id": self.id, "choices": [], "usage": usage})

    def render(self, _: int, out: RequestOutput) -> bytes:
        """One chunk per choice with new tokens (the last one with finish_reason and routed_experts)."""
        self.final = out if out.finished else self.final
        so = self.req.stream_options  # vLLM's: continuous_usage_stats counts only with include_usage
        continuous = so is not None and bool(so.continuous_usage_stats and so.include_usage)
        events = []
        for comp in out.outputs:
            start, done = self.sent.get(comp.index, 0), comp.finished()
            if start < 0 or (start == len(comp.token_ids) and not done):
                continue
            tokens = slice(start, len(comp.token_ids))
            self.sent[comp.index] = -1 if done else len(comp.token_ids)  # -1: closed
            lp = self._logprobs(comp, tokens)
            choice = {"index": comp.index, "logprobs": None if lp is None else lp.model_dump(),
                      "finish_reason": comp.finish_reason if done else None, "token_ids": comp.token_ids[tokens],
                      "routed_experts": routes_b64(comp.routed_experts) if done else None}
            usage = usage_dict(len(out.prompt_token_ids), len(comp.token_ids)) if continuous else None
            events.append(sse({"request_id": self.id, "choices": [choice], "usage": usage}))
        return b"".join(events)
