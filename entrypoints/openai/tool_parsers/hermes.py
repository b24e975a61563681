"""`hermes`: Hermes / Qwen2.5 / Qwen3 calls, `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
(several in a row for parallel calls); the text outside the tags is the content."""

from __future__ import annotations

from typing import Any

from .base import INVALID, ToolCall
from .json_call import body_start, read_json_call
from .tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    name = "hermes"

    def read_call(self, body: str, complete: bool) -> ToolCall | None | Any:
        start = body_start(body)
        if start is None:
            return INVALID if complete else None
        if body[start] != "{":
            return INVALID
        call, end = read_json_call(body, start, complete)
        if complete and call is not INVALID and body[end:].strip():
            return INVALID  # text after the object inside the tags
        return call
