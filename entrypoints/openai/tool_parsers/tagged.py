"""TaggedToolParser: calls written between an opening and a closing tag (`<tool_call>...</tool_call>`), the
rest of the output is content. Subclasses read one call's body (hermes: JSON, qwen3_xml: XML-like)."""

from __future__ import annotations

from typing import Any

from .base import INVALID, Parsed, ToolCall, ToolParser, outside_text


class TaggedToolParser(ToolParser):
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def read_call(self, body: str, complete: bool) -> ToolCall | None | Any:
        """One call's body (between the tags). complete=True: the body is all there (closed, or the output
        ended): a ToolCall, or INVALID. complete=False: a ToolCall with the arguments so far once the name is
        known, else None (INVALID when the body can already be no call)."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        pieces: list[str] = []  # the text before each call (a span that is no call counts as text)
        calls: list[ToolCall] = []
        text_run, pos = "", 0
        while True:
            start = text.find(self.start_tag, pos)
            if start < 0:
                text_run += text[pos:]
                break
            body_at = start + len(self.start_tag)
            end = text.find(self.end_tag, body_at)
            closed = end >= 0
            body = text[body_at:end] if closed else text[body_at:]
            call = self.read_call(body, complete=closed or final)
            if call is INVALID or (call is None and (closed or final)):
                stop = end + len(self.end_tag) if closed else len(text)
                text_run += text[pos:stop]  # no call: its text is content
                pos = stop
                if not closed:
                    break
                continue
            text_run += text[pos:start]
            if call is None:  # an open call whose name is not complete yet: nothing of it is certain
                pieces.append(text_run)
                text_run = ""
                break
            pieces.append(text_run)
            text_run = ""
            calls.append(call)
            if not closed:
                break
            pos = end + len(self.end_tag)
        if len(pieces) > len(calls):  # stopped at an open call with no name yet: the text before it is the tail
            return Parsed(outside_text(pieces[:-1], pieces[-1], True, final, ""), calls)
        return Parsed(outside_text(pieces, text_run, bool(calls), final, self.start_tag), calls)
