"""StructuredOutputsParams: vLLM's per-request output constraint (JSON schema, regex, choice, grammar, any JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .json_depth import MAX_DEPTH, check, value_exceeds

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_FIELDS = (*_KINDS, "disable_any_whitespace")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's field names). The engine compiles it with xgrammar against the model's
    tokenizer and masks every token the constraint forbids at each step (docs/structured_outputs.md).

    json: a JSON schema (a dict, or its JSON text); regex: the whole output fullmatches it; choice: the output
    is one of these strings; grammar: an EBNF (GBNF-style, xgrammar's dialect) grammar whose rule `root` is the
    whole output; json_object: True = any JSON object. Whether a schema, regex or grammar is well-formed is
    checked when the request is admitted (it needs xgrammar), not here."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: JSON output without whitespace between tokens beyond the separators (xgrammar's any_whitespace=False);
    # by default JSON may hold any whitespace where JSON allows it.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            got = ", ".join(set_kinds) or "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)} (got {got})")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or a JSON string), "
                             f"got {type(self.json).__name__}")
        if _too_deep(self.json):
            raise ValueError(f"structured_outputs.json nests arrays/objects more than {MAX_DEPTH} levels deep")
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            for j, c in enumerate(self.choice):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice[{j}] must be a non-empty string")
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true when set, got {self.json_object!r}")

    @classmethod
    def from_dict(cls, value: Any) -> StructuredOutputsParams:
        """A dict of the same fields (the server's `structured_outputs` body field, a pickled-free form)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown} (known: {', '.join(_FIELDS)})")
        return cls(**value)

    @property
    def kind(self) -> str:
        """The one constraint set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """A hashable identity of the constraint."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return self.kind, str(value), self.disable_any_whitespace


def _too_deep(schema: Any) -> bool:
    """A schema (text or dict) nested past MAX_DEPTH: json.loads, copy.deepcopy (SamplingParams.clone) and
    xgrammar recurse once per level and would run out of stack (a RecursionError, not a ValueError)."""
    if isinstance(schema, dict):
        return value_exceeds(schema, MAX_DEPTH)
    if isinstance(schema, str):
        try:
            check(schema.encode("utf-8", "surrogatepass"), MAX_DEPTH)
        except ValueError:  # NestedTooDeep
            return True
    return False
