"""Ground floor: SpeculativeConfig, the validated `speculative_config` engine option (n-gram prompt lookup)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram",)  # methods this build implements (vLLM also has draft models, EAGLE, MTP, ...)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names and defaults. method "ngram" (prompt lookup, docs/speculative_decoding.md): each decoding
    step, the longest suffix of prompt + output of prompt_lookup_max .. prompt_lookup_min tokens that occurred
    earlier proposes the num_speculative_tokens tokens that followed it; one forward verifies them all."""

    method: str = "ngram"
    num_speculative_tokens: int = 1  # k: most drafted tokens per request per step (the dict form must give it)
    prompt_lookup_max: int | None = None  # longest n-gram tried (vLLM: prompt_lookup_min when only that is given)
    prompt_lookup_min: int | None = None  # shortest n-gram tried (vLLM: prompt_lookup_max when only that is given)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not supported (supported: "
                             f"{', '.join(SPECULATIVE_METHODS)}; draft-model, EAGLE and MTP methods are not built)")
        _check_positive("num_speculative_tokens", self.num_speculative_tokens)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        # vLLM's defaults: only one given -> the other equals it; neither -> both 5.
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        _check_positive("prompt_lookup_min", lo)
        _check_positive("prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """The engine option as given (a dict with vLLM's keys, or an instance) -> a validated instance."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or SpeculativeConfig), got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown} (known: {sorted(known)})")
        for key in ("method", "num_speculative_tokens"):  # vLLM requires both for ngram
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r} (e.g. {{'method': 'ngram', "
                                 "'num_speculative_tokens': 4}})")
        return cls(**value)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
