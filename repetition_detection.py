"""Ground floor: RepetitionDetectionParams (vLLM's names) and the tail check that stops a looping request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

# CompletionOutput.stop_reason of a request stopped by repetition detection (vLLM's value).
REPETITION_STOP_REASON = "repetition_detected"


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """Stop a request whose output ends in a pattern of L tokens (min_pattern_size <= L <= max_pattern_size)
    repeated min_count times back to back (vLLM's SamplingParams.repetition_detection).

    max_pattern_size = 0 turns detection off; min_pattern_size = 0 means 1. Only the tail is checked, once per
    new token: at most sum over L of L * (min_count - 1) comparisons, whatever the output length."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, bool):
                raise ValueError(f"repetition_detection.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0 with "
                             f"min_pattern_size <= max_pattern_size, got min_pattern_size={self.min_pattern_size}, "
                             f"max_pattern_size={self.max_pattern_size} (both 0 turn detection off)")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be >= 2 to detect a repeated pattern, got "
                             f"{self.min_count} (max_pattern_size=0 turns detection off)")

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    @classmethod
    def coerce(cls, value: Any) -> RepetitionDetectionParams:
        """The params themselves, or a dict of their fields (the HTTP body's JSON object, vLLM's form)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"max_pattern_size", "min_pattern_size", "min_count"})
            if unknown:
                raise ValueError(f"repetition_detection has unknown fields {unknown}; it takes max_pattern_size, "
                                 "min_pattern_size and min_count")
            return cls(**value)
        raise ValueError(f"repetition_detection must be a RepetitionDetectionParams or a dict of its fields, got "
                         f"{type(value).__name__}")


def has_repeated_tail(token_ids: Sequence[int], num_output_tokens: int, params: RepetitionDetectionParams) -> bool:
    """Do the last `num_output_tokens` of `token_ids` (prompt + output: no copy of the output is made) end in some
    pattern of L tokens (min..max) repeated params.min_count times in a row? Prompt tokens never count."""
    n = num_output_tokens
    count = params.min_count
    for length in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        if length * count > n:
            return False  # longer patterns need even more tokens
        # Position -k of the output must equal position -(k + length * m) for every earlier copy m.
        if all(token_ids[-k] == token_ids[-(k + length * m)]
               for k in range(1, length + 1) for m in range(1, count)):
            return True
    return False
