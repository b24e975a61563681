"""What every tool-call parser shares: the parsed call, the parser interface, the text-outside-calls rule, and the
stream that turns successive parses of a growing output into OpenAI `delta.tool_calls` chunks.

A parser reads the whole output so far each time (`parse(text, final)`); streaming sends the difference to what
it sent before. Every parse of a longer prefix extends the previous one (content and each call's arguments only
grow, calls only get appended), so the streamed pieces concatenate to the non-streamed result. The one exception
is an output that ends inside a call it cannot complete (cut by max_tokens, malformed JSON): the stream may have
sent that call's name already, while the final parse gives its text back as content."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (while streaming: the text so far)."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """An output read as calls: `content` the text outside them ("" none), `calls` in order."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


INVALID = object()  # a call span whose text is complete but no call (a parser's read_call result)


class ToolParser:
    """Reads tool calls out of a model's output. `tools`: the request's tools ({"type": "function", "function":
    {name, description, parameters}} dicts), for parsers that convert values by the parameter schemas."""

    name = ""

    def __init__(self, tools: list[dict[str, Any]]):
        self.tools = tools

    def parse(self, text: str, final: bool) -> Parsed:
        """The calls in `text`. final=False: `text` may still grow: the content and the arguments are what is
        certain so far, and a call appears once its name is complete. final=True: the whole output; a call that
        does not parse is content."""
        raise NotImplementedError


def new_call_id() -> str:
    """OpenAI's form: "call_" and 24 characters."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def outside_text(pieces: list[str], tail: str, has_calls: bool, final: bool, marker: str) -> str:
    """The content of an output: the text outside its calls. `pieces`: the text before each call, `tail`: the text
    after the last (all of it when there is no call). Whitespace-only text next to calls is dropped (the newline
    between two calls is no content); without calls the final content is the whole text. While streaming
    (final=False) the tail is held back while it is whitespace only, and so is its end while it could be the
    beginning of `marker` (a call opening)."""
    out = "".join(p for p in pieces if p.strip())
    if final:
        return out + tail if tail.strip() or not has_calls else out
    visible = tail[:len(tail) - _held_marker(tail, marker)] if marker else tail
    return out + visible if visible.strip() else out


class ToolCallStream:
    """One streamed choice's tool calls: each `delta(text, final)` returns the OpenAI delta fields (`content`,
    `tool_calls`) new since the last call; a call's first delta has its index, id, type and name (and the
    arguments so far), the later ones argument fragments. `max_calls`: 1 with parallel_tool_calls=false."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.content_sent = ""
        self.sent: list[list[str]] = []  # per call: [id, arguments sent]
        self.called = False  # whether any call was sent

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        parsed = limit_calls(self.parser.parse(text, final), self.max_calls)
        out: dict[str, Any] = {}
        if parsed.content.startswith(self.content_sent) and len(parsed.content) > len(self.content_sent):
            out["content"] = parsed.content[len(self.content_sent):]
            self.content_sent = parsed.content
        calls = []
        for i, call in enumerate(parsed.calls):
            if i == len(self.sent):
                self.sent.append([new_call_id(), call.arguments])
                calls.append({"index": i, "id": self.sent[i][0], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif i < len(self.sent):
                done = self.sent[i][1]
                if len(call.arguments) > len(done) and call.arguments.startswith(done):
                    calls.append({"index": i, "function": {"arguments": call.arguments[len(done):]}})
                    self.sent[i][1] = call.arguments
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out


def limit_calls(parsed: Parsed, max_calls: int | None) -> Parsed:
    """parallel_tool_calls=false: only the first call is kept (as vLLM: the output is not cut short)."""
    if max_calls is not None and len(parsed.calls) > max_calls:
        parsed.calls = parsed.calls[:max_calls]
    return parsed
