"""vLLM's BeamSearchParams (`from vllm.sampling_params import BeamSearchParams`): the options of
`LLM.beam_search` (entrypoints/beam_search.py runs it). Here, at the bottom floor, so that sampling_params can
re-export it under vLLM's import path."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, lo in (("temperature", 0.0), ("length_penalty", -math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < math.inf:
                raise ValueError(f"{name} must be a finite number{' >= 0' if lo == 0.0 else ''}, got {value!r}")
