"""POST /v1/responses' body: OpenAI's Responses API, text subset, plus chat's sampling extras (`extra_body`).

Its messages become a ChatCompletionRequest (`chat_request`): the Responses API runs on the chat pipeline.
Accepted and answered: `input` (a string, or message items whose content is a string or input_text /
output_text parts), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `top_logprobs` with
`include: ["message.output_text.logprobs"]`, `stream`, `store`, `previous_response_id`, `metadata` (echoed).
Tools, reasoning, background mode and non-text formats are 400 "not supported".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from ..http.errors import bad_request
from .chat_messages import ChatMessage
from .input_check import Metadata, User
from .openai_protocol import ChatCompletionRequest
from .protocol_fields import Int, _Body, _only, _ranged, _Strict
from .sampling_fields import model_with_sampling_fields

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat's fields a Responses body may also carry (vLLM extras through `extra_body`), passed on unchanged.
PASSED = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos", "min_tokens",
          "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
          "allowed_token_ids", "logit_bias", "priority", "trace_decode_token_ids", "trace_replay_chunk_size",
          "trace_routed_experts", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
          "structured_outputs", "return_tokens_as_token_ids")


class InputText(_Strict):
    """A content part: the caller's text, or an earlier answer's output_text sent back."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = _only(None, [])  # an output_text part sent back: none are made here
    logprobs: list[Any] | None = None  # an output_text part sent back: accepted, ignored (cannot change the output)


class InputMessage(_Strict):
    """OpenAI's EasyInputMessage / input message item; `id` and `status` come with an output message sent back
    and are ignored (they cannot change the output)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = None  # an output message's label ("commentary", "final_answer") sent back: ignored

    def chat_message(self) -> ChatMessage:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return ChatMessage(role=self.role, content=text)  # parts joined as chat joins text parts


class TextFormat(_Strict):
    type: Literal["text"]  # json_schema / json_object: not supported here (use structured_outputs)


class TextConfig(_Strict):
    format: TextFormat | None = None


_Sampling = model_with_sampling_fields("_ResponsesSampling", PASSED, "Chat's sampling fields, as on chat.", _Body)


class ResponsesRequest(_Sampling):
    model: str | None = None  # null: the served model
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None  # a system message first; not carried to a follow-up (as OpenAI)
    max_output_tokens: Int | None = _ranged(minimum=1)  # null: up to max_model_len
    top_logprobs: Int | None = _ranged(minimum=0)  # alternatives per token, with include's logprobs
    include: list[Literal["message.output_text.logprobs"]] | None = None
    stream: bool | None = False
    store: bool | None = True  # keep the response (GET /v1/responses/{id}, previous_response_id)
    previous_response_id: str | None = None  # continue that stored response's conversation
    metadata: Metadata | None = None  # echoed in the response; <= 16 pairs, keys <= 64 characters, values <= 512
    user: User | None = None  # accepted, ignored (cannot change the output); <= 256 characters
    text: TextConfig | None = None
    tools: list[Any] | None = _only(None, [])
    tool_choice: str | None = _only(None, "none", "auto")
    parallel_tool_calls: bool | None = None
    reasoning: Any = _only(None)
    background: bool | None = _only(None, False)
    truncation: str | None = _only(None, "disabled")
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's chat extra (e.g. enable_thinking)

    @field_validator("input", mode="before")
    @classmethod
    def _only_messages(cls, value: Any) -> Any:
        """Items other than messages (function calls and their outputs, reasoning, ...): one clear error."""
        if isinstance(value, list) and not value:
            raise ValueError("input must be a string or a non-empty list of message items, got []")
        for i, item in enumerate(value if isinstance(value, list) else ()):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in (None, "message"):
                raise ValueError(f"input[{i}] is a {kind!r} item: not supported by replayllm's Responses API, "
                                 "which takes message items only (no tools or reasoning items)")
        return value

    def check(self) -> None:
        if self.tools:
            raise bad_request("tools are not supported by replayllm's Responses API", "tools", "not_implemented")
        for name, allowed in (("tool_choice", (None, "none", "auto")), ("reasoning", (None,)),
                              ("background", (None, False)), ("truncation", (None, "disabled"))):
            if getattr(self, name) not in allowed:
                raise bad_request(f"{name} {getattr(self, name)!r} is not supported by replayllm's Responses API",
                                  name, "not_implemented")
        if self.top_logprobs is not None and not self.wants_logprobs:
            raise bad_request(f"top_logprobs needs include: [\"{LOGPROBS_INCLUDE}\"] (logprobs are only returned "
                              "then)", "top_logprobs")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def input_messages(self) -> list[ChatMessage]:
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        return [m.chat_message() for m in self.input]

    def chat_request(self, history: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request this one runs as: [instructions as a system message] + `history` (the previous
        response's conversation) + the input messages; max_output_tokens as max_completion_tokens, include's
        logprobs as logprobs + top_logprobs, every passed sampling field as it is."""
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        fields: dict[str, Any] = {name: getattr(self, name) for name in PASSED if name in self.model_fields_set}
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.wants_logprobs:
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.chat_template_kwargs is not None:
            fields["chat_template_kwargs"] = self.chat_template_kwargs
        return ChatCompletionRequest(model=self.model, messages=messages + history + self.input_messages(),
                                     stream=bool(self.stream), **fields)


# A chat request's fields (named in its errors) -> the Responses field they came from.
CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                     "max_tokens": "max_output_tokens", "logprobs": "include"}
