"""The Responses API's response object (OpenAI's `response`, text output only) and its streamed events."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from ...outputs import CompletionOutput
from .streaming import sse

Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    # with include ["message.output_text.logprobs"]: chat's entries {token, logprob, bytes, rank, top_logprobs}
    logprobs: list[dict[str, Any]] | None = None


class OutputMessage(BaseModel):
    id: str  # "msg_<hex>"
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning output item (--reasoning-parser: the output's <think> span), before the message, as OpenAI's
    and vLLM's Responses API give it: its text in `content`, no summary."""

    id: str  # "rs_<hex>"
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None
    status: Status


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class TextFormatOut(BaseModel):
    type: Literal["text"] = "text"


class TextOut(BaseModel):
    format: TextFormatOut = Field(default_factory=TextFormatOut)


class ResponseObject(BaseModel):
    """OpenAI's `response`: the settings it ran with, its output message and usage."""

    id: str  # "resp_<hex>"
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Status
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[ReasoningItem | OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: None = None
    store: bool = True
    temperature: float | None = None
    text: TextOut = Field(default_factory=TextOut)
    tool_choice: Literal["none", "auto"] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


def finished_status(comp: CompletionOutput) -> tuple[Status, IncompleteDetails | None]:
    """A finished choice's status: cut by max_output_tokens (or max_model_len) -> incomplete, as OpenAI."""
    if comp.finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    return "completed", None


class EventWriter:
    """SSE events of one streamed response: `event: <type>` + `data: {..., "sequence_number": k}`, k from 0."""

    def __init__(self):
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n".encode() + sse(data)
