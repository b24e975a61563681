"""tool_choice "required" and a named function: the output is constrained (structured outputs) to be calls, so no
tag format is needed. Named: the output is the function's arguments object. Required (as vLLM): a JSON array of
`{"name": ..., "parameters": {...}}` items, each valid for one of the tools. The schemas, and the parsers that
read such outputs back (arguments: the raw JSON text the grammar let through)."""

from __future__ import annotations

import json
from typing import Any

from .base import INVALID, Parsed, ToolCall, ToolParser
from .json_call import read_json_call
from .json_scan import skip_ws

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The array of calls tool_choice "required" allows: one or more (exactly one with parallel_tool_calls=false).
    The tools' `$defs` move to the root, where their `#/$defs/...` references point (ValueError when two tools
    define one name differently)."""
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(parameters_schema(tool))
        for name, schema in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != schema:
                raise ValueError(f"tools define $defs {name!r} differently; give the definitions one name each")
            defs[name] = schema
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """The whole output is one call's arguments (its surrounding whitespace dropped)."""

    def __init__(self, tools: list[dict[str, Any]], function: str):
        super().__init__(tools)
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        args = text.strip() if final else text.lstrip()
        if not final:
            args = args[:len(args.rstrip())]  # trailing whitespace may be the end (dropped) or inside (kept)
        return Parsed("", [ToolCall(self.function, args)])


class RequiredToolParser(ToolParser):
    """`[{"name": "f", "parameters": {...}}, ...]`; an output that is no such array (cut by max_tokens) is
    content."""

    def parse(self, text: str, final: bool) -> Parsed:
        if final and not _is_call_array(text):
            return Parsed(text)
        calls: list[ToolCall] = []
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return Parsed("")
        pos = skip_ws(text, pos + 1)
        while text.startswith("{", pos):
            call, end = read_json_call(text, pos, complete=final)
            if call is None or call is INVALID:
                break
            calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if text.startswith(",", pos):
                pos = skip_ws(text, pos + 1)
        return Parsed("", calls)


def _is_call_array(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(
        isinstance(v, dict) and isinstance(v.get("name"), str) and "parameters" in v for v in value)
