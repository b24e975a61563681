"""Ground floor: the reasoning span's start/end tokens (<think> / </think>) that thinking_token_budget counts and
that structured outputs wait for (EngineConfig.reasoning_parser)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# vLLM's ReasoningConfig names; the defaults are Qwen3's (and DeepSeek-R1's) reasoning delimiters.
DEFAULT_THINK_START_STR = "<think>"
DEFAULT_THINK_END_STR = "</think>"


# vLLM's --reasoning-parser names built here (entrypoints/openai/reasoning_parser.py splits the text; the engine
# applies a request's structured outputs only after the reasoning span, EngineConfig.reasoning_parser).
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def check_reasoning_parser(name: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not supported (choose from {', '.join(REASONING_PARSERS)})")
    return name


def check_reasoning_strings(think_start_str: str | None, think_end_str: str | None,
                            reasoning_parser: str | None = None) -> None:
    """EngineConfig.think_start_str / think_end_str: both None (the defaults) or both non-empty strings; its
    reasoning_parser: None or a name of REASONING_PARSERS."""
    if reasoning_parser is not None:
        check_reasoning_parser(reasoning_parser)
    for name, value in (("think_start_str", think_start_str), ("think_end_str", think_end_str)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"{name} must be None or a non-empty string, got {value!r}")
    if (think_start_str is None) != (think_end_str is None):
        raise ValueError("think_start_str and think_end_str must be set together (a reasoning span needs both "
                         "its start and its end token)")


@dataclass(frozen=True)
class ReasoningTokens:
    """The single token ids that open and close a reasoning span, resolved once from the tokenizer."""

    start_token_id: int
    end_token_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer, think_start_str: str | None = None,
                       think_end_str: str | None = None) -> ReasoningTokens | None:
        """With think_start_str / think_end_str (the engine options), each must be one token (ValueError
        otherwise); without them, <think> / </think> when the tokenizer has each as one token, else None (the
        model has no reasoning span: a request with a thinking_token_budget is then rejected)."""
        if tokenizer is None:
            return None
        explicit = think_start_str is not None
        strings = {"think_start_str": think_start_str if explicit else DEFAULT_THINK_START_STR,
                   "think_end_str": think_end_str if explicit else DEFAULT_THINK_END_STR}
        ids = []
        for name, text in strings.items():
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                if not explicit:
                    return None
                raise ValueError(f"{name} = {text!r} is {len(encoded)} tokens in this tokenizer; the reasoning "
                                 "start and end must each be a single token")
            ids.append(int(encoded[0]))
        if ids[0] == ids[1]:
            raise ValueError(f"think_start_str and think_end_str map to the same token id {ids[0]}")
        return cls(ids[0], ids[1])

    def ended_in(self, token_ids: Sequence[int]) -> bool:
        """vLLM's is_reasoning_end: the last reasoning tag in `token_ids` is the end token (a prompt whose template
        closed the span, e.g. enable_thinking=False's empty <think></think>); no tag at all: False."""
        for token in reversed(token_ids):
            if token == self.end_token_id:
                return True
            if token == self.start_token_id:
                return False
        return False

    def state_after(self, token_ids: Sequence[int]) -> tuple[bool, int]:
        """(inside a reasoning span, tokens generated in it so far) after `token_ids` (prompt + any output). A span
        opens at the first start token after the last end token and runs to the next end token; a start token
        inside a span is one more reasoning token (spans do not nest). The count is the tokens after the span's
        start token: a prompt that opened <think> counts its own reasoning tokens, as vLLM does."""
        tokens = np.asarray(token_ids)
        ends = np.flatnonzero(tokens == self.end_token_id)
        after = int(ends[-1]) + 1 if ends.size else 0
        starts = np.flatnonzero(tokens[after:] == self.start_token_id)
        if starts.size == 0:
            return False, 0
        return True, len(tokens) - (after + int(starts[0])) - 1
