"""Trace file lines as pydantic models (extra keys forbidden) and their JSON Schema (docs/trace_file.schema.json)."""

from __future__ import annotations

import json
import math
from numbers import Integral, Real
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

# A log-probability is <= 0; a small positive value is tolerated as rounding from the producer's log_softmax.
MAX_LOGPROB = 1e-4
# A top-k's probabilities sum to at most 1 (a truncated top-k sums to less). Past exp(0.1) ~ 1.105 they cannot
# come from one distribution: fp32 terms move the sum by ~k x 6e-8, and a trainer's bf16 log_softmax (spacing
# 2^-8 near a logprob of -1; a top-1 rounded to 0.0 beside its alternatives) by a few percent, which is read.
MAX_TOP_LOGSUMEXP = 0.1
PROVENANCE_KEY = "provenance"

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
LogProb = Annotated[float, Field(le=MAX_LOGPROB, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]
# An expert id as `routed_experts` stores it: int16 like the engine's capture, -1 for a dense layer's rows.
ExpertId = Annotated[int, Field(ge=-1, le=32767)]
_PER_TOKEN = {"logprobs": "number", "top_logprobs": "object"}  # fields with one entry per trace token


class TraceFileError(ValueError):
    """A trace file (or one of its lines) is malformed; the message names the file and line."""


class TraceHeader(BaseModel):
    """The optional first line: where the traces came from (model, resolved engine config, versions, settings)."""

    model_config = ConfigDict(extra="forbid", title="trace file header line")
    provenance: dict[str, Any] = Field(description="free-form facts about the producer; `replayllm capture` writes "
                                                   "model, engine config, versions and sampling settings")


class TraceRequest(BaseModel):
    """One request: a prompt (text or token ids) and the trace of tokens to force after it, optionally with the
    producer's logprobs of each trace token."""

    model_config = ConfigDict(extra="forbid", title="trace file request line")
    id: Annotated[str, Field(min_length=1)] | int = Field(description="unique in the file (integers are read as their "
                                                          "decimal string)")
    prompt: str | None = Field(None, min_length=1, description="the prompt text; tokenized with the model's "
                               "tokenizer (special tokens added) when prompt_token_ids is absent")
    prompt_token_ids: TokenIds | None = Field(None, description="the prompt's token ids; wins over prompt")
    trace_token_ids: TokenIds = Field(description="the tokens to force after the prompt, in order")
    logprobs: list[LogProb] | None = Field(None, description="the producer's logprob of each trace token (one per "
                                           "trace token); the diff's `file` side reads them")
    top_logprobs: list[dict[TokenIdKey, LogProb]] | None = Field(
        None, description="per trace token, the producer's top-k {\"token id\": logprob}")
    routed_experts: list[list[list[ExpertId]]] | None = Field(
        None, description="the producer's routes, [len(prompt) + len(trace) - 1][num_layers][top_k]: row p holds "
        "the experts each layer routed token p to (most probable first; -1 on a dense layer), as replayllm's "
        "CompletionOutput.routed_experts; the diff's `file` side reads them for its router agreement")
    meta: dict[str, Any] | None = Field(None, description="free-form, carried through untouched")

    @field_validator("id", mode="before")
    @classmethod
    def _id(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise TraceFileError(f"'id' must be a non-empty string or an integer, got {value!r}")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if value is not None and (not isinstance(value, str) or not value):
            raise TraceFileError(f"'prompt' must be a non-empty string, got {value!r}")
        return value

    @field_validator("trace_token_ids", "prompt_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, value: Any, info) -> Any:
        if value is None:  # only prompt_token_ids may be None (trace_token_ids is required)
            return value
        key = info.field_name
        if not isinstance(value, list) or not value:
            raise TraceFileError(f"{key!r} must be a non-empty list of token ids, got {describe(value)}")
        if all(type(t) is int and t >= 0 for t in value):  # the common case, ~20x faster than the ABC check
            return list(value)
        for i, t in enumerate(value):
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
                raise TraceFileError(f"{key}[{i}] must be a non-negative integer token id, got {t!r}")
        return [int(t) for t in value]

    @field_validator("logprobs", "top_logprobs", mode="before")
    @classmethod
    def _per_token(cls, value: Any, info) -> Any:
        """Each entry checked here (their count against the trace in _whole)."""
        if value is None:
            return value
        key = info.field_name
        if not isinstance(value, list):
            raise TraceFileError(f"{key!r} must be a list with one {_PER_TOKEN[key]} per trace token, "
                                 f"got {describe(value)}")
        if key == "logprobs":
            return [_logprob(f"logprobs[{i}]", v) for i, v in enumerate(value)]
        for i, d in enumerate(value):
            if not isinstance(d, dict):
                raise TraceFileError(f"top_logprobs[{i}] must be an object {{\"token id\": logprob}}, "
                                     f"got {describe(d)}")
            for k, v in d.items():
                if not (k.isascii() and k.isdigit()):
                    raise TraceFileError(f"top_logprobs[{i}] key {k!r} is not a token id (a decimal integer string)")
                _logprob(f"top_logprobs[{i}][{k!r}]", v)
            _top_mass(i, d.values())
        return value

    @field_validator("routed_experts", mode="before")
    @classmethod
    def _routes(cls, value: Any) -> Any:
        """A rectangular [rows, layers, k] array of integer ids in [-1, 32767], checked at numpy speed (a long
        trace of a 48-layer model holds ~10^5 ids); the row count against the prompt in _whole."""
        if value is None:
            return value
        if not isinstance(value, list) or not value:
            raise TraceFileError(f"'routed_experts' must be a non-empty [positions][layers][top_k] list of expert "
                                 f"ids, got {describe(value)}")
        try:
            routes = np.asarray(value)
        except ValueError:  # ragged nesting
            routes = None
        if routes is None or routes.ndim != 3 or 0 in routes.shape:
            raise TraceFileError("'routed_experts' must be a rectangular [positions][layers][top_k] list of "
                                 "expert ids (every row the same number of layers, every layer the same top_k)")
        if routes.dtype.kind not in "iu":
            raise TraceFileError(f"'routed_experts' holds non-integer values ({routes.dtype.name}); expert ids are "
                                 "integers (-1 on a dense layer)")
        if routes.min() < -1 or routes.max() > 32767:
            bad = int(routes.min()) if routes.min() < -1 else int(routes.max())
            raise TraceFileError(f"'routed_experts' holds expert id {bad}; ids are in [-1, 32767]")
        return value

    @field_validator("meta", mode="before")
    @classmethod
    def _meta(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, dict):
            raise TraceFileError(f"'meta' must be a JSON object, got {describe(value)}")
        return value

    @model_validator(mode="after")
    def _whole(self) -> TraceRequest:
        if self.prompt is None and self.prompt_token_ids is None:
            raise TraceFileError("needs 'prompt' (text) or 'prompt_token_ids'")
        n = len(self.trace_token_ids)
        for key, what in _PER_TOKEN.items():
            value = getattr(self, key)
            if value is not None and len(value) != n:
                raise TraceFileError(f"{key!r} must be a list with one {what} per trace token ({n}), "
                                     f"got {describe(value)}")
        if self.routed_experts is not None and self.prompt_token_ids is not None:  # text prompts: checked by the diff
            rows = len(self.prompt_token_ids) + n - 1
            if len(self.routed_experts) != rows:
                raise TraceFileError(f"'routed_experts' must hold one row per routed position, len(prompt_token_ids) "
                                     f"+ len(trace_token_ids) - 1 = {rows}, got {describe(self.routed_experts)}")
        return self


def validate_request(obj: dict[str, Any]) -> TraceRequest:
    """A request line's JSON object -> TraceRequest; TraceFileError with the first problem (unknown keys first,
    then missing ones, then the fields in order)."""
    try:
        return TraceRequest.model_validate(obj)
    except ValidationError as e:
        raise TraceFileError(first_error(e)) from None


def validate_header(obj: dict[str, Any]) -> TraceHeader:
    try:
        return TraceHeader.model_validate(obj)
    except ValidationError:
        raise TraceFileError(f"a header line holds only {PROVENANCE_KEY!r}, a JSON object") from None


def first_error(e: ValidationError) -> str:
    errors = e.errors()
    unknown = sorted(str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden")
    if unknown:
        allowed = ", ".join(TraceRequest.model_fields)
        return f"unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {allowed}"
    missing = [err for err in errors if err["type"] == "missing"]
    err = (missing or errors)[0]
    if err["type"] == "missing":
        return f"missing {err['loc'][0]!r}"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, TraceFileError):
        return str(cause)
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def describe(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:80]


def _logprob(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TraceFileError(f"{key} must be a finite number, got {value!r}")
    if value > MAX_LOGPROB:
        raise TraceFileError(f"{key} = {value!r} is positive; logprobs are log-probabilities (<= 0)")
    return float(value)


def _top_mass(i: int, logprobs) -> None:
    """One position's top-k holds at most all of the probability (checked for the reader; a schema cannot)."""
    values = list(logprobs)
    if not values:
        return
    top = max(values)
    total = top + math.log(sum(math.exp(v - top) for v in values))
    if total > MAX_TOP_LOGSUMEXP:
        raise TraceFileError(f"top_logprobs[{i}]: its probabilities sum to {math.exp(total):.4g} > 1 (logsumexp "
                             f"{total:.4g}); they cannot be one distribution's top-k")


def json_schema() -> dict[str, Any]:
    """The JSON Schema of one line of a trace file (JSONL): a header line (first line only) or a request."""
    schema = TypeAdapter(TraceHeader | TraceRequest).json_schema()
    request = schema["$defs"]["TraceRequest"]
    # What pydantic does not state: a prompt, as text or ids (the reader's rule); top-k keys are token ids only.
    request["anyOf"] = [{"required": [key], "properties": {key: {"not": {"type": "null"}}}}
                        for key in ("prompt", "prompt_token_ids")]
    request["properties"]["top_logprobs"]["anyOf"][0]["items"]["additionalProperties"] = False
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "replayllm trace file line",
            "description": "A trace file is JSONL: an optional header line, then one request per line (ids unique; "
                           "blank lines allowed). See docs/diff.md, \"Trace file format\".", **schema}


def schema_text() -> str:
    """docs/trace_file.schema.json's text (tests/diff/test_trace_schema.py checks the committed file; regenerate it with
    `make trace-schema` after changing the models)."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"
