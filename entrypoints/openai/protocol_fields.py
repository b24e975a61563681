"""The building blocks of the request bodies (openai_protocol.py, chat_messages.py, tokenize_protocol.py,
generate_protocol.py, responses_protocol.py): the two model bases (nested objects and top-level bodies, both
strict in their types and keeping unknown fields aside), integer fields that take a zero-fraction number, and the
schema-only field helpers that make /openapi.json state what is accepted. The validation policy: openai_protocol.py."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, WrapValidator, model_serializer

from .input_check import integral_floats


def _ranged(default: Any = None, **bounds: Any) -> Any:
    """A field whose OpenAPI schema states the range SamplingParams accepts (`minimum`, `maximum`,
    `exclusiveMinimum`, `minItems`, `propertyNames`; `items_minimum` for a list's entries), so the documented
    schema is what is accepted.
    Documentation only: the value is checked once, by SamplingParams, whose 400s name the field."""
    extra: dict[str, Any] = {k: v for k, v in bounds.items() if not k.startswith("items_")}
    if "items_minimum" in bounds:
        extra["items"] = {"type": "integer", "minimum": bounds["items_minimum"]}
    return Field(default, json_schema_extra=extra)


def _nonempty(*, lists: bool) -> Any:
    """Schema only (the values are checked by SamplingParams / the engine): every string in the field has
    minLength 1, every token id minimum 0 and, with `lists`, every list minItems 1."""

    def schema(s: dict) -> None:
        for branch in s.get("anyOf", [s]):
            kind = branch.get("type")
            if kind == "string":
                branch["minLength"] = 1
            elif kind == "integer":
                branch["minimum"] = 0
            elif kind == "array":
                if lists:
                    branch["minItems"] = 1
                schema(branch["items"])

    return schema


def _only(*values: Any, default: Any = None) -> Any:
    """A field replayllm accepts only with these values (any other is a 400 "not supported"): its schema is
    that enum, so the document does not promise what the server refuses."""

    def schema(s: dict) -> None:
        s.clear()
        s["enum"] = list(values)

    return Field(default, json_schema_extra=schema)


_EMPTY = (None, False, 0, "", [], {})  # what a replayed assistant message may carry in an unsupported field
# Integers (and lists of them) that also take a JSON number with a zero fraction (5.0): JSON Schema's `integer`
# does, as vLLM does; one validator call per field, not per list entry (a trace may hold a million ids).
Int = Annotated[int, WrapValidator(integral_floats)]
Ids = Annotated[list[int], WrapValidator(integral_floats)]


class _Strict(BaseModel):
    """A nested object (a message, stream_options, ...): strict types; keys it does not know kept aside in
    `model_extra`, for the policy of the body holding it (request_fields.py), as the body's own unknown fields."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_serializer(mode="wrap")
    def _known_fields_only(self, handler):
        """model_dump() leaves the unknown keys out (they were ignored: a dumped tool or repetition_detection
        carries none of them on), at every depth."""
        data = handler(self)
        for key in self.model_extra or ():
            data.pop(key, None)
        return data


class _Body(BaseModel):
    """A request body: strict types, and fields it does not know kept aside in `model_extra` for the server's
    policy (request_fields.py: ignored and named, or a 400 with --strict-request-fields)."""

    model_config = ConfigDict(extra="allow", strict=True)
    # What the server ignored of this body (unknown fields, chat_template_kwargs the template does not read), in
    # the order found: the x-replayllm-ignored-fields header.
    _ignored: list[str] = PrivateAttr(default_factory=list)

    def ignore(self, names: list[str]) -> None:
        self._ignored.extend(n for n in names if n not in self._ignored)

    @property
    def ignored_fields(self) -> list[str]:
        return list(self._ignored)
