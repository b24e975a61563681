"""Tool-call parsers (vLLM's `--tool-call-parser` names): read a model's output into OpenAI `tool_calls`."""

from __future__ import annotations

from .base import Parsed, ToolCall, ToolCallStream, ToolParser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .qwen3_xml import Qwen3XmlToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Qwen3XmlToolParser, Llama3JsonToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of a `--tool-call-parser` name (ValueError naming the known ones)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not known (known: {', '.join(sorted(TOOL_PARSERS))})")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "Parsed", "ToolCall", "ToolCallStream", "ToolParser", "get_tool_parser"]
