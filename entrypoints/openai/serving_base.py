"""ServingBase: what every route class over the engine shares: the engine client, the served model names, the
limits, the checks each request body gets first, and queueing a request under a fresh id."""

from __future__ import annotations

import uuid

from pydantic import BaseModel

from ...context_limits import max_tokens_too_large
from ...engine.protocol import EngineClient
from ...engine.request_stream import RequestStream
from ...sampling_params import RequestOutputKind, SamplingParams
from ..http.intake_gate import leave_intake
from ..http.limits import RequestLimits
from ..http.request_log import log_request
from .openai_protocol import check_model, served_names
from .request_fields import apply_field_policy


class ServingBase:
    """The state and the steps the serving classes (completions, chat, generate, tokenize) have in common."""

    def __init__(self, engine: EngineClient, model_name: str | tuple[str, ...], limits: RequestLimits,
                 default_sampling: dict | None = None, strict_fields: bool = False):
        self.engine = engine
        self.limits = limits
        self.default_sampling = default_sampling or {}  # --generation-config
        self.strict_fields = strict_fields  # --strict-request-fields: unknown fields are 400s (request_fields.py)
        self.model_names = served_names(model_name)
        self.model_name = self.model_names[0]  # what responses report

    def admit(self, req: BaseModel) -> None:
        """The checks every body gets before its own, in this order: the model it names is served (404; a
        malformed name 400), then the unknown-field policy (400 when strict, else ignored and named)."""
        check_model(req.model, self.model_names)
        apply_field_policy(req, self.strict_fields)

    def check_room(self, asked: int | None, params: SamplingParams, prompt_lens: list[int]) -> None:
        """vLLM's server check: a `max_tokens` (or `max_completion_tokens`) the request carries must fit beside
        each prompt in max_model_len (a 400 naming both numbers), where the offline LLM stops at the context.
        Not with a trace (its length is max_tokens, cut to fit: trace_rules.fit), nor with truncate_prompt_tokens
        -1 ("keep what fits": the output stops at the context). `prompt_lens`: before truncate_prompt_tokens, which
        is applied here as the engine will."""
        limit, keep = self.limits.max_model_len, params.truncate_prompt_tokens
        if asked is None or params.has_trace or not limit or keep == -1:
            return
        for n in prompt_lens:
            n = n if keep is None else min(n, keep)
            if n < limit and n + asked > limit:  # a prompt that is too long on its own gets its own error
                raise max_tokens_too_large(asked, n, limit)

    async def queue(self, id_prefix: str, prompts: list[dict], params: SamplingParams, prompt_lens: list[int],
                    streamed: bool, base: str | None = None) -> tuple[str, RequestStream]:
        """Queue one engine request per prompt (all or nothing) as "{id_prefix}-<hex>": (that id, the stream).
        `base` (the client's request_id / X-Request-Id): the id shown is "{id_prefix}-{base}", as vLLM's; the
        engine's gets a random suffix, so two requests sent with one id never collide there.
        Not `streamed`: only the final output is rendered, so `params` (our own copy) asks for no per-step
        snapshots. The engine's errors propagate (each route maps them with its own fields)."""
        if not streamed:
            params.output_kind = RequestOutputKind.FINAL_ONLY
        shown = f"{id_prefix}-{base if base is not None else uuid.uuid4().hex}"
        engine_id = shown if base is None else f"{shown}-{uuid.uuid4().hex[:8]}"
        try:
            stream = await self.engine.add_requests(engine_id, prompts, [params] * len(prompts))
        finally:
            leave_intake()  # in the engine's queue (or refused): a request waiting at the gate may go on
        log_request(engine_id, prompt_lens, params)
        return shown, stream
