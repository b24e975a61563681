"""POST /tokenize and /detokenize (vLLM's): a text or chat messages -> token ids, token ids -> text."""

from __future__ import annotations

import json

from starlette.responses import Response

from ...engine.protocol import EngineClient, PromptProcessor
from ..http.limits import RequestLimits, check_detokenize, check_messages, check_prompts
from .input_check import check_text
from .openai_responses import DetokenizeResponse
from .request_fields import dropped_template_kwargs
from .serving_base import ServingBase
from .serving_chat import render_chat
from .streaming import engine_error
from .tokenize_protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

# Every field either body may name: a ValueError whose message starts with one becomes a 400 with that param.
FIELDS = tuple({**TokenizeCompletionRequest.model_fields, **TokenizeChatRequest.model_fields,
                **DetokenizeRequest.model_fields})


def _tokenizer(engine: PromptProcessor, endpoint: str):
    if engine.tokenizer is None:
        raise ValueError(f"/{endpoint} needs a tokenizer; this server was started with --skip-tokenizer-init")
    return engine.tokenizer


def _chat_ids(engine: PromptProcessor, req: TokenizeChatRequest, chat_template: str | None,
              dropped: list[str] | None = None) -> list[int]:
    """The ids /v1/chat/completions would give these messages (its own rendering function)."""
    return render_chat(engine, req.conversation(), bool(req.add_generation_prompt), bool(req.continue_final_message),
                       bool(req.add_special_tokens), req.template_kwargs(), chat_template, dropped,
                       [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)


def _tokenize(engine: PromptProcessor, req: TokenizeCompletionRequest | TokenizeChatRequest,
              chat_template: str | None = None, dropped: list[str] | None = None) -> tuple[list[int], list[str] | None]:
    """(ids, the tokenizer's string per id if asked for); runs on the engine thread, which owns the tokenizer.
    dropped: see render_chat."""
    tok = _tokenizer(engine, "tokenize")
    if isinstance(req, TokenizeChatRequest):
        ids = _chat_ids(engine, req, chat_template, dropped)
    else:  # as /v1/completions tokenizes a text prompt
        ids = engine.tokenize(req.prompt, req.add_special_tokens is not False)
    return ids, tok.convert_ids_to_tokens(ids) if req.return_token_strs else None


def _json_list(values: list, chunk: int = 65536) -> str:
    """json.dumps(values) slice by slice: one json.dumps of 1.3M ids (a 5 MB text) is a single C call that holds
    the GIL for ~0.1-0.3 s; between slices the event loop gets it back."""
    return "[" + ",".join(json.dumps(values[i:i + chunk], ensure_ascii=False)[1:-1]
                          for i in range(0, len(values), chunk)) + "]"


def _tokenize_body(engine: PromptProcessor, req: TokenizeCompletionRequest | TokenizeChatRequest,
                   chat_template: str | None, max_model_len: int, dropped: list[str] | None = None) -> bytes:
    """The TokenizeResponse JSON, rendered here on the tokenizer pool (for a big text it is megabytes)."""
    ids, strs = _tokenize(engine, req, chat_template, dropped)
    return (f'{{"count":{len(ids)},"max_model_len":{max_model_len},"tokens":{_json_list(ids)},'
            f'"token_strs":{"null" if strs is None else _json_list(strs)}}}').encode()


def _detokenize(engine: PromptProcessor, tokens: list[int]) -> str:
    tok = _tokenizer(engine, "detokenize")
    vocab = engine.model_config.prompt_vocab_size  # the bound /v1/completions puts on prompt token ids
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:  # the first bad one by position, never the list
            raise ValueError(f"tokens must be in [0, {vocab}): tokens[{i}] = {t}")
    return tok.decode(tokens)


class TokenizeServer(ServingBase):
    """POST /tokenize and /detokenize over the engine client's tokenizer pool (nothing is queued)."""

    def __init__(self, engine: EngineClient, model_name: str | tuple[str, ...], max_model_len: int,
                 limits: RequestLimits, chat_template: str | None = None, strict_fields: bool = False):
        super().__init__(engine, model_name, limits, strict_fields=strict_fields)
        self.chat_template = chat_template  # --chat-template (None: the tokenizer's)
        self.max_model_len = max_model_len

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        """A TokenizeResponse's JSON. No length check: a prompt longer than max_model_len is counted, which is
        what a caller asks for."""
        self.admit(req)
        if isinstance(req, TokenizeChatRequest):
            req.check_chat_prompt()
            chars = check_messages(req, self.limits)
        else:
            chars = check_prompts([req.prompt], self.limits)
        check_text(req)
        dropped = None if self.strict_fields else []
        try:
            body = await self.engine.run_tokenizer(
                lambda e: _tokenize_body(e, req, self.chat_template, self.max_model_len, dropped), size=chars)
        except Exception as e:
            raise engine_error(e, FIELDS) from e
        dropped_template_kwargs(req, req.template_kwarg_fields(dropped or []) if dropped else [])
        return Response(body, media_type="application/json")

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.admit(req)
        check_detokenize(req.tokens, self.limits)
        try:
            text = await self.engine.run_tokenizer(lambda e: _detokenize(e, req.tokens), size=len(req.tokens))
        except Exception as e:
            raise engine_error(e, FIELDS) from e
        return DetokenizeResponse(prompt=text)
