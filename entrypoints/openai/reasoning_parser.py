"""vLLM's `--reasoning-parser` (qwen3, deepseek_r1): a chat completion's `<think>...</think>` span goes to
`reasoning_content`, the rest to `content`, in whole responses and in streamed deltas alike.

The split is on the output text, the same for a whole text and for any cut of it into deltas (held back while a
tag may be starting): streamed reasoning and content deltas concatenate to the whole response's fields.
- qwen3: reasoning only when the output opens with `<think>` (Qwen3's hybrid models write it themselves; with
  enable_thinking=False they write none and everything is content), or when the prompt left a `<think>` open
  (Qwen3-Thinking templates put it there): up to `</think>`, the rest content.
- deepseek_r1: the output is reasoning up to `</think>` whether or not it opens with `<think>` (R1's template
  puts it in the prompt, older ones not at all); no `</think>` yet: all reasoning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...reasoning import (  # noqa: F401 (REASONING_PARSERS re-exported: the server's names)
    DEFAULT_THINK_END_STR,
    DEFAULT_THINK_START_STR,
    REASONING_PARSERS,
    ReasoningTokens,
    check_reasoning_parser,
)

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningParser:
    """A server's --reasoning-parser with the tokenizer's <think> / </think> ids (None: it has no such single
    tokens, so no prompt opens a span)."""

    name: str
    tokens: ReasoningTokens | None
    # The tokenizer marks <think> / </think> special: skip_special_tokens (the default) would drop them from the
    # text, so a request that does not set it gets False (vLLM's parsers for such tokenizers do the same).
    tags_special: bool = False

    @classmethod
    def load(cls, name: str, tokenizer) -> ReasoningParser:
        """Resolved once, on the tokenizer's thread."""
        tokens = ReasoningTokens.from_tokenizer(tokenizer)
        special = tokens is not None and tokenizer.decode([tokens.start_token_id], skip_special_tokens=True) == ""
        return cls(check_reasoning_parser(name), tokens, special)

    def prompt_opened(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the rendered prompt ends inside a <think> span (its template opened one for the model)."""
        return self.tokens is not None and bool(prompt_token_ids) and self.tokens.state_after(prompt_token_ids)[0]

    def splitter(self, prompt_token_ids: Sequence[int]) -> ReasoningSplitter:
        return ReasoningSplitter(self.name, self.prompt_opened(prompt_token_ids))

    def split(self, prompt_token_ids: Sequence[int], text: str) -> tuple[str | None, str | None]:
        return split_reasoning(self.name, text, self.prompt_opened(prompt_token_ids))


class ReasoningSplitter:
    """One choice's text, fed as it grows: `feed(delta)` and, at the end, `flush()` each give the (reasoning,
    content) text released so far. A suffix that may be the start of the tag awaited is held until known."""

    def __init__(self, parser: str, prompt_opened: bool = False):
        check_reasoning_parser(parser)
        # What the text is after the opening (a leading <think>, or none): reasoning or content.
        self.default = _REASONING if parser == "deepseek_r1" or prompt_opened else _CONTENT
        self.state = _START
        self.held = ""
        self.saw_reasoning = False  # a reasoning span opened (its text may be empty)

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = [], []
        text = self.held + text
        self.held = ""
        while text:
            if self.state == _START:
                if text.startswith(DEFAULT_THINK_START_STR):
                    self._enter(_REASONING)
                    text = text[len(DEFAULT_THINK_START_STR):]
                elif DEFAULT_THINK_START_STR.startswith(text):
                    self.held, text = text, ""  # may still become "<think>"
                else:
                    self._enter(self.default)
            elif self.state == _REASONING:
                end = text.find(DEFAULT_THINK_END_STR)
                if end >= 0:
                    reasoning.append(text[:end])
                    self._enter(_CONTENT)
                    text = text[end + len(DEFAULT_THINK_END_STR):]
                else:
                    keep = _partial_suffix(text, DEFAULT_THINK_END_STR)
                    reasoning.append(text[:len(text) - keep])
                    self.held, text = text[len(text) - keep:], ""
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The held text, as what it would have been had no tag followed."""
        held, self.held = self.held, ""
        if self.state == _START:
            self._enter(self.default)
        return (held, "") if self.state == _REASONING else ("", held)

    def _enter(self, state: str) -> None:
        self.state = state
        self.saw_reasoning = self.saw_reasoning or state == _REASONING


def split_reasoning(parser: str, text: str, prompt_opened: bool = False) -> tuple[str | None, str | None]:
    """A whole output -> (reasoning_content, content), as vLLM's message fields: reasoning None when the output
    had no reasoning span; content None when a reasoning span left nothing after it."""
    splitter = ReasoningSplitter(parser, prompt_opened)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    reasoning, content = r1 + r2, c1 + c2
    if not splitter.saw_reasoning:
        return None, content
    return reasoning, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def message_fields(parser: ReasoningParser | None, prompt_token_ids: Sequence[int], text: str) -> dict:
    """A whole chat message's text fields: {"content"} without a parser, else content and reasoning_content."""
    if parser is None:
        return {"content": text}
    reasoning, content = parser.split(prompt_token_ids, text)
    return {"content": content, "reasoning_content": reasoning}


class StreamedReasoning:
    """The streamed deltas' text fields of a request's choices: {"content": text} without a parser, else the
    reasoning_content and/or content each delta adds (a choice's splitter flushed with its last delta)."""

    def __init__(self, parser: ReasoningParser | None):
        self.parser = parser
        self.splitters: dict[int, ReasoningSplitter] = {}

    def delta(self, index: int, prompt_token_ids: Sequence[int], text: str, last: bool) -> dict:
        if self.parser is None:
            return {"content": text}
        splitter = self.splitters.get(index)
        if splitter is None:
            splitter = self.splitters[index] = self.parser.splitter(prompt_token_ids)
        reasoning, content = splitter.feed(text)
        if last:
            held_reasoning, held_content = splitter.flush()
            reasoning, content = reasoning + held_reasoning, content + held_content
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if content or not reasoning:
            delta["content"] = content
        return delta
