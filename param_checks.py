"""The checks and normalisations of SamplingParams' fields (one ValueError per bad value, naming the field): ints,
enums, bounded reals, string and token-id lists, logit_bias (and clamp_logit_bias, OpenAI's range for the API)."""

from __future__ import annotations

import enum
import json
import math
import os
from numbers import Integral, Real
from typing import Any, TypeVar

_FP32_MAX = 3.4028234663852886e38
_MAX_LOGIT_BIAS = 100.0  # OpenAI's range: from_optional and the server clamp to it, as vLLM; the constructor does not


_E = TypeVar("_E", bound=enum.IntEnum)


def is_int(value: Any) -> bool:
    # bool is an Integral subclass; True as a token count or seed is a caller bug, not a value.
    return isinstance(value, Integral) and not isinstance(value, bool)


def int_field(name: str, value: Any, minimum: int, *, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if not is_int(value) or value < minimum:
        kind = "None or an integer" if allow_none else "an integer"
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {value!r}")
    return int(value)  # numpy integers become plain ints


def enum_field(name: str, value: Any, kind: type[_E]) -> _E:
    # The member or its int value; a name string or a bool is a caller bug, not a value.
    if isinstance(value, kind):
        return value
    if is_int(value) and int(value) in {m.value for m in kind}:
        return kind(int(value))
    members = ", ".join(f"{m.name}={m.value}" for m in kind)
    raise ValueError(f"{name} must be a {kind.__name__} ({members}) or its int value, got {value!r}")


def real_field(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        if lo == 0 and hi == math.inf:
            sign = "positive" if lo_open else "non-negative"
            raise ValueError(f"{name} must be a finite {sign} number, got {value!r}")
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be a number in {left}{lo}, {hi}], got {value!r}")
    return float(value)


def str_list(name: str, value: Any) -> list[str]:
    """Errors name the first bad position and never echo the input (a list may hold 10k strings)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, "
                         f"got {type(value).__name__}")
    for j, s in enumerate(items):
        if not isinstance(s, str):
            raise ValueError(f"{name}[{j}] must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"{name}[{j}] is an empty string: each entry must be non-empty")
    return list(items)


def id_list(name: str, value: Any, *, allow_empty: bool = True) -> list[int]:
    """Errors name the first bad position and never echo the input (a trace may hold a million ids)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of non-negative integer token ids, got {type(value).__name__}")
    if not (value or allow_empty):
        raise ValueError(f"{name} must be a non-empty list of non-negative integer token ids")
    for j, t in enumerate(value):
        if not is_int(t):
            raise ValueError(f"{name}[{j}] must be an integer token id, got {type(t).__name__}")
        if t < 0:
            raise ValueError(f"{name}[{j}] = {t} is negative: token ids are >= 0")
    return [int(t) for t in value]


def clamp_logit_bias(bias: dict) -> dict:
    """Finite numeric biases clamped to OpenAI's [-100, 100] (vLLM's OpenAI path and from_optional; others are
    left for the constructor's checks)."""
    return {t: min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, b)) if is_number(b) and math.isfinite(b) else b
            for t, b in bias.items()}


def is_number(b: Any) -> bool:
    return isinstance(b, Real) and not isinstance(b, bool)


def logit_bias_field(value: Any) -> dict[int, float] | None:
    """{token id: bias}, the biases as given (vLLM's SamplingParams; clamp_logit_bias is the API's range)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    bad_ids = [t for t in value if not (is_int(t) and t >= 0)]
    if bad_ids:
        raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {bad_ids[:8]!r}")
    # finite in fp32, the logits' dtype where they are added (a 1e39 would be inf there, and a softmax of it NaN)
    bad_biases = {t: b for t, b in value.items() if not (is_number(b) and abs(b) <= _FP32_MAX)}
    if bad_biases:
        raise ValueError("logit_bias values must be finite numbers (within float32's +-3.4e38), got "
                         f"{dict(list(bad_biases.items())[:8])!r}")
    return {int(t): float(b) for t, b in value.items()}


def env_flag(name: str) -> bool:
    """An on/off environment variable as vLLM reads them (an int): unset, "" or "0" off, "1" on; anything else
    ("true", "yes") a ValueError rather than silently off."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1, got {value!r}")
    return value == "1"


def json_object(text: str) -> dict:
    """A command-line value that must be a JSON object (--speculative-config, --override-generation-config, ...);
    ValueError for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value
