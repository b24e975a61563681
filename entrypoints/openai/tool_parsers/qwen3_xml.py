"""`qwen3_xml`: Qwen3-Coder's calls, `<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n
</function>\\n</tool_call>`. Values are text, converted to the JSON type the tool's parameter schema gives
(string when unknown); the arguments are the JSON object of the parameters, streamed one whole parameter at a
time (`{"p": value` then `, "q": ...` then `}`)."""

from __future__ import annotations

import json
import math
from typing import Any

from .base import INVALID, ToolCall
from .json_scan import skip_ws
from .tagged import TaggedToolParser

FUNCTION, PARAMETER = "<function=", "<parameter="
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"


class Qwen3XmlToolParser(TaggedToolParser):
    name = "qwen3_xml"

    def read_call(self, body: str, complete: bool) -> ToolCall | None | Any:
        pos = skip_ws(body, 0)
        if not body.startswith(FUNCTION, pos):
            return INVALID if complete or not FUNCTION.startswith(body[pos:]) else None
        name_end = body.find(">", pos)
        if name_end < 0:
            return INVALID if complete else None
        name = body[pos + len(FUNCTION):name_end].strip()
        if not name:
            return INVALID
        params: list[tuple[str, Any]] = []
        pos, closed = name_end + 1, False
        while True:
            pos = skip_ws(body, pos)
            rest = body[pos:]
            if rest.startswith(FUNCTION_END):
                closed = True
                if complete and body[pos + len(FUNCTION_END):].strip():
                    return INVALID  # text after </function> inside the call
                break
            if rest.startswith(PARAMETER):
                key_end = body.find(">", pos)
                value_end, next_pos = _value_end(body, key_end + 1) if key_end >= 0 else (None, None)
                if value_end is None:
                    if complete:
                        return INVALID
                    break  # the parameter still grows
                key = body[pos + len(PARAMETER):key_end].strip()
                params.append((key, self._convert(name, key, body[key_end + 1:value_end])))
                pos = next_pos
                continue
            if complete or not (FUNCTION_END.startswith(rest) or PARAMETER.startswith(rest)):
                if complete and not rest:
                    break  # the output ended after whole parameters: the call is complete
                return INVALID
            break
        members = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                            for k, v in params)
        return ToolCall(name, "{" + members + ("}" if closed or complete else ""))

    def _convert(self, function: str, key: str, raw: str) -> Any:
        """A parameter's text as the JSON value its schema's type says (one newline each side is layout)."""
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        kind = _param_type(self.tools, function, key)
        if value.lower() == "null" and kind != "string":
            return None
        try:
            if kind in ("integer", "int"):
                return int(value.strip())
            if kind in ("number", "float"):
                number = float(value.strip())
                if not math.isfinite(number):
                    return value
                return int(number) if number.is_integer() and value.strip().lstrip("-").isdigit() else number
            if kind in ("boolean", "bool"):
                return {"true": True, "false": False}.get(value.strip().lower(), value)
            if kind in ("object", "array", "dict", "list"):
                return json.loads(value)
        except ValueError:
            return value
        return value


def _value_end(body: str, start: int) -> tuple[int | None, int | None]:
    """(end of a parameter's value, where the next item starts): at </parameter>, or, when the model left it
    out, before the next <parameter= or </function>; (None, None) while it may still grow."""
    end = body.find(PARAMETER_END, start)
    if end >= 0:
        return end, end + len(PARAMETER_END)
    ends = [i for i in (body.find(PARAMETER, start), body.find(FUNCTION_END, start)) if i >= 0]
    return (min(ends), min(ends)) if ends else (None, None)


def _param_type(tools: list[dict], function: str, key: str) -> str:
    """The JSON Schema type of a tool's parameter ("string" when the tool, the parameter or its type is unknown)."""
    for tool in tools:
        fn = tool.get("function") or {}
        if fn.get("name") == function:
            prop = ((fn.get("parameters") or {}).get("properties") or {}).get(key) or {}
            kind = prop.get("type", "string")
            if isinstance(kind, list):
                kind = next((k for k in kind if k != "null"), "string")
            return kind if isinstance(kind, str) else "string"
    return "string"
