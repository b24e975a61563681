"""One call written as a JSON object, `{"name": ..., "arguments": {...}}` (hermes; llama3_json's key is
`parameters`): read while it grows, the arguments kept as the model wrote them (raw JSON text)."""

from __future__ import annotations

import json
from typing import Any

from .base import INVALID, ToolCall
from .json_scan import object_members, skip_ws

ARGUMENT_KEYS = ("arguments", "parameters")


def read_json_call(text: str, start: int, complete: bool) -> tuple[ToolCall | None | Any, int | None]:
    """The call in the object opening at text[start] ('{'), and the object's end (None: not closed). Its
    arguments: the raw text of the "arguments" (or "parameters") value, "{}" when absent; while the value
    grows, the text so far when it is an object or array (a scalar only once complete). complete=True: the text
    holds all of the call: INVALID unless it is an object with a string "name"."""
    members, end = object_members(text, start)
    if complete:
        if end is None:
            return INVALID, None
        try:
            obj = json.loads(text[start:end])
        except ValueError:
            return INVALID, None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return INVALID, end
    by_key = {}
    for m in members:
        by_key.setdefault(m.key, m)
    name_member = by_key.get("name")
    if name_member is None or name_member.end is None:
        return None, end
    try:
        name = json.loads(text[name_member.start:name_member.end])
    except ValueError:
        return INVALID, end
    if not isinstance(name, str):
        return INVALID, end
    args = next((by_key[k] for k in ARGUMENT_KEYS if k in by_key), None)
    if args is None:
        return ToolCall(name, "{}" if complete or end is not None else ""), end
    if args.end is not None:
        return ToolCall(name, text[args.start:args.end]), end
    grows = text[args.start] in "{["
    return ToolCall(name, text[args.start:] if grows else ""), end


def body_start(body: str) -> int | None:
    """Where the JSON object of a call body begins (None: only whitespace so far)."""
    pos = skip_ws(body, 0)
    return pos if pos < len(body) else None
