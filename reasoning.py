"""Ground floor: the reasoning span's start/end tokens (<think> / </think>) that thinking_token_budget counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# vLLM's ReasoningConfig names; the defaults are Qwen3's (and DeepSeek-R1's) reasoning delimiters.
DEFAULT_THINK_START_STR = "<think>"
DEFAULT_THINK_END_STR = "</think>"
_REASONING_KEYS = ("think_start_str", "think_end_str")


def check_reasoning_config(value: Any) -> dict[str, str] | None:
    """EngineConfig.reasoning_config: None, or {"think_start_str": str, "think_end_str": str} (vLLM's keys)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(_REASONING_KEYS):
        raise ValueError(f"reasoning_config must be None or a dict with exactly the keys {list(_REASONING_KEYS)}, "
                         f"got {value!r}")
    for key in _REASONING_KEYS:
        if not isinstance(value[key], str) or not value[key]:
            raise ValueError(f"reasoning_config[{key!r}] must be a non-empty string, got {value[key]!r}")
    return dict(value)


@dataclass(frozen=True)
class ReasoningTokens:
    """The single token ids that open and close a reasoning span, resolved once from the tokenizer."""

    start_token_id: int
    end_token_id: int

    @classmethod
    def from_tokenizer(cls, tokenizer, reasoning_config: dict[str, str] | None) -> ReasoningTokens | None:
        """With `reasoning_config`, its strings must each be one token (ValueError otherwise); without it,
        <think> / </think> when the tokenizer has each as one token, else None (the model has no reasoning
        span: a request with a thinking_token_budget is then rejected)."""
        if tokenizer is None:
            return None
        strings = reasoning_config or {"think_start_str": DEFAULT_THINK_START_STR,
                                       "think_end_str": DEFAULT_THINK_END_STR}
        ids = []
        for key in _REASONING_KEYS:
            encoded = tokenizer.encode(strings[key], add_special_tokens=False)
            if len(encoded) != 1:
                if reasoning_config is None:
                    return None
                raise ValueError(f"reasoning_config[{key!r}] = {strings[key]!r} is {len(encoded)} tokens in this "
                                 "tokenizer; the reasoning start and end must each be a single token")
            ids.append(int(encoded[0]))
        if ids[0] == ids[1]:
            raise ValueError(f"the reasoning start and end strings map to the same token id {ids[0]}")
        return cls(ids[0], ids[1])

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
