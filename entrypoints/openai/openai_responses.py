"""OpenAI response bodies (completions, chat, models, streaming chunks, (de)tokenize) and the logprob renderings."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field, model_serializer

from ...outputs import Logprob, PromptLogprobs

# JSON has no -inf; like vLLM, report an impossible token as -9999.
_MIN_LOGPROB = -9999.0


def _now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


# MoE models served with --enable-return-routed-experts (docs/moe.md): a finished choice's experts per position,
# layer and choice, [seq_len - 1][num_layers][top_k] (CompletionOutput.routed_experts as lists; dense layers -1).
# Absent from the JSON otherwise (not null: a server without the option does not grow a field).
RoutedExperts = list[list[list[int]]] | None
ROUTED_EXPERTS_FIELD: Any = Field(None, exclude_if=lambda v: v is None)


def routed_experts_json(routes) -> RoutedExperts:
    """CompletionOutput.routed_experts (int16 [P, L, k] or None) -> nested lists for a choice."""
    return None if routes is None else routes.tolist()


# -- completions ---------------------------------------------------------------------------------------
class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    # replayllm: each token's 1-based rank under the raw logits (how far a forced trace token was from top-1)
    token_ranks: list[int | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string / token id that ended the choice
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: RoutedExperts = ROUTED_EXPERTS_FIELD


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


# -- chat ----------------------------------------------------------------------------------------------
class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTopLogprob):
    rank: int | None = None  # replayllm: 1-based rank of the token under the raw logits
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str  # "call_..."
    type: str = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # The calls read from the output (tool_calling.py); null when none (the key is there, as OpenAI's SDK types)
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # --reasoning-parser: the <think> span (reasoning_parser.py)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser

    @model_serializer
    def _drop_nulls(self) -> dict[str, Any]:  # OpenAI deltas omit absent keys ({} closes a choice)
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: RoutedExperts = ROUTED_EXPERTS_FIELD


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's new tokens
    routed_experts: RoutedExperts = ROUTED_EXPERTS_FIELD  # the closing chunk


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # first chunk, with return_token_ids


# -- models --------------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "replayllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


# -- tokenize ------------------------------------------------------------------------------------------
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs: the tokenizer's string per id


class DetokenizeResponse(BaseModel):
    prompt: str


# -- logprob renderings --------------------------------------------------------------------------------
def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def token_text(token_id: int, lp: Logprob | None, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token_id}"
    return (lp.decoded_token if lp is not None else None) or ""


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int,
                        as_ids: bool, texts: list[str] | None = None) -> tuple[dict[str, list], int]:
    """OpenAI's completions format (CompletionLogProbs's fields, as a dict: streamed chunks encode it with
    msgspec, a whole response validates it into the model), and the character offset after the last token.
    `entries[i]` is token i's dict (chosen token + top-k; None for the first prompt token, which nothing
    predicts); `texts` overrides the decoded strings (prompt tokens); `offset` is the first token's offset."""
    text_offset, token_logprobs, tokens, top_logprobs, token_ranks = [], [], [], [], []
    for i, (tid, entry) in enumerate(zip(token_ids, entries)):
        chosen = entry.get(tid) if entry is not None else None
        decoded = texts[i] if texts is not None else token_text(tid, chosen, False)
        tokens.append(f"token_id:{tid}" if as_ids else decoded)
        text_offset.append(offset)
        offset += len(decoded)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            token_ranks.append(None)
            continue
        token_logprobs.append(_lp(chosen.logprob))
        token_ranks.append(chosen.rank)
        # Every entry the engine returned (the chosen token plus the top-k), keyed by its text, as vLLM does.
        top_logprobs.append({token_text(t, lp, as_ids): _lp(lp.logprob) for t, lp in entry.items()})
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs, "token_ranks": token_ranks}, offset


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], top_n: int,
                  as_ids: bool) -> ChatLogprobs:
    """OpenAI's chat format: each token's logprob plus its `top_n` alternatives (by rank; -1: every one read)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        text = token_text(tid, chosen, as_ids)
        n = len(entry) if top_n == -1 else top_n
        tops = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n),
                      key=lambda kv: kv[1].rank)[:n]
        content.append(ChatLogprobEntry(
            token=text, logprob=_lp(chosen.logprob), bytes=list(text.encode()), rank=chosen.rank,
            top_logprobs=[ChatTopLogprob(token=token_text(t, lp, as_ids), logprob=_lp(lp.logprob),
                                         bytes=list(token_text(t, lp, as_ids).encode())) for t, lp in tops]))
    return ChatLogprobs(content=content)


def render_prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else
            {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in d.items()} for d in prompt_logprobs]
