"""Trace files: JSONL, an optional provenance header line, then one request per line; reading validates every
line (the pydantic models of trace_schema.py) and names the line on error."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .trace_schema import PROVENANCE_KEY, TraceFileError, TraceRequest, validate_header, validate_request

# Every key a line may carry (docs/trace_replay.md describes each); anything else is rejected, not ignored.
TRACE_KEYS = tuple(TraceRequest.model_fields)


@dataclass(frozen=True)
class TraceRecord:
    """One request of a trace file.

    `prompt_token_ids` wins over `prompt` when both are present (the text is then informational); with only
    `prompt`, the text is tokenized with the model's tokenizer (special tokens added, as the engine does).
    """

    id: str
    trace_token_ids: list[int]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[float] | None = None  # [len(trace)] reference logprob of each trace token
    top_logprobs: list[dict[int, float]] | None = None  # [len(trace)] {token id: logprob}, the producer's top-k
    meta: dict | None = None  # free-form, carried through untouched
    line: int | None = None  # 1-based line in the file it was read from (for error messages)
    # [len(prompt) + len(trace) - 1][num_layers][top_k] expert ids (-1: dense layer), as CompletionOutput.
    # routed_experts; nested lists (not numpy) so records compare with ==. None: not stored.
    routed_experts: list[list[list[int]]] | None = None

    @property
    def where(self) -> str:
        return f"request {self.id!r}" + (f" (line {self.line})" if self.line is not None else "")

    def to_json(self) -> dict[str, Any]:
        """The JSONL object of this record (only the keys that are set)."""
        obj: dict[str, Any] = {"id": self.id}
        if self.prompt is not None:
            obj["prompt"] = self.prompt
        if self.prompt_token_ids is not None:
            obj["prompt_token_ids"] = list(self.prompt_token_ids)
        obj["trace_token_ids"] = list(self.trace_token_ids)
        if self.logprobs is not None:
            obj["logprobs"] = [float(x) for x in self.logprobs]
        if self.top_logprobs is not None:
            obj["top_logprobs"] = [{str(t): float(v) for t, v in d.items()} for d in self.top_logprobs]
        if self.routed_experts is not None:
            routes = self.routed_experts  # a numpy array given by a caller is written as nested lists too
            obj["routed_experts"] = routes.tolist() if hasattr(routes, "tolist") else routes
        if self.meta is not None:
            obj["meta"] = self.meta
        return obj


@dataclass(frozen=True)
class TraceFile:
    """A whole trace file: its requests and its provenance header (None in files without one)."""

    records: list[TraceRecord]
    provenance: dict[str, Any] | None = None


def read_traces(path: str | os.PathLike) -> list[TraceRecord]:
    """Read and validate a trace file's requests. Raises TraceFileError naming the file and line of the first
    problem."""
    return read_trace_file(path).records


def read_trace_file(path: str | os.PathLike) -> TraceFile:
    """Read and validate a trace file, its provenance header included (see docs/diff.md)."""
    records: list[TraceRecord] = []
    provenance = None
    for item in iter_trace_file(path):
        if isinstance(item, TraceRecord):
            records.append(item)
        else:
            provenance = item
    if not records:
        raise TraceFileError(f"trace file {os.fspath(path)!r} holds no requests")
    return TraceFile(records, provenance)


def iter_trace_file(path: str | os.PathLike) -> Iterator[TraceRecord | dict[str, Any]]:
    """Stream a trace file line by line, validating each: the provenance header (a dict) first when there is
    one, then one TraceRecord per request. Only the ids seen so far are kept (duplicates are an error)."""
    name = os.fspath(path)
    seen: dict[str, int] = {}
    header_allowed = True
    try:
        f = open(name, encoding="utf-8-sig")  # a BOM (Windows editors) is not part of the JSON
    except OSError as e:
        raise TraceFileError(f"cannot read trace file {name!r}: {e.strerror or e}") from e
    with f:
        number = 0
        while True:
            try:
                text = f.readline()
            except UnicodeDecodeError as e:
                raise TraceFileError(f"trace file {name!r} is not UTF-8 text: {e}") from e
            if not text:
                return
            number += 1
            if not text.strip():
                continue  # blank lines are allowed (e.g. a trailing newline)
            try:
                header = _provenance_line(text)
                if header is not None:
                    if not header_allowed:
                        raise TraceFileError(f"a {PROVENANCE_KEY!r} header must be the file's first line")
                    header_allowed = False
                    yield header
                    continue
                record = parse_trace_line(text, number)
            except TraceFileError as e:
                raise TraceFileError(f"{name} line {number}: {e}") from None
            header_allowed = False
            if record.id in seen:
                raise TraceFileError(f"{name} line {number}: duplicate id {record.id!r} "
                                     f"(first on line {seen[record.id]})")
            seen[record.id] = number
            yield record


def _provenance_line(text: str) -> dict[str, Any] | None:
    """The header's provenance object when `text` is a header line (`{"provenance": {...}}`), else None."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None  # parse_trace_line reports it
    if not (isinstance(obj, dict) and PROVENANCE_KEY in obj):
        return None
    return validate_header(obj).provenance


def parse_trace_line(text: str, line: int | None = None) -> TraceRecord:
    """One JSONL line -> TraceRecord. Raises TraceFileError (without the file/line prefix)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFileError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceFileError(f"each line must be a JSON object, got {type(obj).__name__}")
    r = validate_request(obj)
    top = None if r.top_logprobs is None else [{int(k): v for k, v in d.items()} for d in r.top_logprobs]
    return TraceRecord(str(r.id), r.trace_token_ids, r.prompt, r.prompt_token_ids, r.logprobs, top, r.meta, line,
                       r.routed_experts)


def write_traces(path: str | os.PathLike, records: Iterable[TraceRecord],
                 provenance: dict[str, Any] | None = None) -> int:
    """Write records as JSONL (one object per line), after a provenance header line when given. Returns the
    number of records written."""
    n = 0
    with open(os.fspath(path), "w", encoding="utf-8") as f:
        if provenance is not None:
            f.write(json.dumps({PROVENANCE_KEY: provenance}, ensure_ascii=False, allow_nan=False) + "\n")
        for record in records:
            f.write(json.dumps(record.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
            n += 1
    return n
