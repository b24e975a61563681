"""`llama3_json`: Llama 3.1/3.2's JSON calls: the output is `{"name": "f", "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`. An output that does not start with a call object is all content;
text after the last call (or from the first object that is no call on) is content."""

from __future__ import annotations

from .base import INVALID, Parsed, ToolCall, ToolParser, outside_text
from .json_call import read_json_call
from .json_scan import skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(PYTHON_TAG))
        elif pos == len(text) or PYTHON_TAG.startswith(text[pos:]):
            return Parsed(text if final else "")  # undecided: nothing or the tag's beginning so far
        if pos == len(text) or text[pos] != "{":
            return Parsed(text if final or pos < len(text) else "")
        calls: list[ToolCall] = []
        while pos < len(text) and text[pos] == "{":
            call, end = read_json_call(text, pos, complete=final)
            if end is not None and not final:
                call, end = read_json_call(text, pos, complete=True)  # closed: judged now as the end will
            if call is INVALID:
                break
            if call is None or end is None:
                if call is not None:
                    calls.append(call)
                return Parsed("", calls)  # the call still grows
            calls.append(call)
            pos = skip_ws(text, end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
        if not calls:
            return Parsed(text if final else "")
        return Parsed(outside_text([], text[pos:], True, final, ""), calls)
