"""The chat request's message and tool objects (OpenAI's shapes; strict, nested in ChatCompletionRequest and
chat-style /tokenize bodies)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .protocol_fields import _EMPTY, _only, _Strict


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object (null: no arguments)
    strict: bool | None = None  # enforced with tool_choice "required" / named (constrained); a 400 with "auto"


class ChatTool(_Strict):
    """One entry of `tools` (OpenAI's only kind: a function)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """A call in a replayed assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # Sent back by clients that replay an assistant message object; only empty values are accepted.
    tool_calls: list[ToolCallIn] | None = None  # an assistant message's calls (its tool messages answer them)
    function_call: Any = _only(*_EMPTY)
    refusal: str | None = _only(None, "")
    audio: Any = _only(*_EMPTY)
    annotations: list[Any] | None = _only(None, [])
    # An assistant message's reasoning sent back (what --reasoning-parser returned): given to the chat template as
    # both `reasoning_content` (Qwen3's templates read it) and `reasoning`, as vLLM passes them.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)  # as vLLM joins text parts
        return self.content or ""
