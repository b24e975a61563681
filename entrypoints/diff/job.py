"""DiffJob: what compare()'s traces, sides and options (DiffOptions) resolve to, validated before any side runs."""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ..distributed.options import ScaleOut
from .localize import check_localizable
from .route_plan import RoutePlan, plan_routes
from .side_checks import check_side, check_vocab_sizes, model_not_found
from .sides import DiffRequest
from .spec import ENGINE, SideSpec, SpecError, parse_spec
from .trace_file import TraceFileError, TraceRecord, read_trace_file


class DiffWarning(UserWarning):
    """Something the diff runs as asked but a reader should know (the CLI prints it as one `warning:` line)."""


@dataclass(frozen=True)
class DiffOptions:
    """compare()'s keyword options (its docstring says what each means), bundled once; the Ray ones as a
    ScaleOut."""

    model: str | None = None
    full_vocab: bool = False
    top_k: int = 20
    threshold: float = 1e-3
    batch_size: int = 32
    noise_factor: float = 10.0
    localize: int = 0
    trace_replay_chunk_size: int | None = None
    progress: bool = False
    scale_out: ScaleOut = ScaleOut()
    fix_routes: str | None = None


@dataclass
class DiffJob:
    """Everything compare() runs: the two sides (after --fix-routes planning), the requests resolved to token ids,
    the route plan, what each side resolved to (resolved.py), the tokenizer (None without one) and the source."""

    sides: tuple[SideSpec, SideSpec]
    requests: list[DiffRequest]
    plan: RoutePlan
    resolved: tuple[dict, dict]
    tokenizer: object | None
    path: str | None  # the trace file read (None: records were given)
    provenance: dict | None  # the trace file's provenance header, if any


def prepare_job(traces: str | os.PathLike | Sequence[TraceRecord], a: str | SideSpec, b: str | SideSpec,
                opts: DiffOptions) -> DiffJob:
    """Read and check the traces, both SPECs and every option; raises ValueError (SpecError / TraceFileError)
    before any side has run. The checks run in this order, so the first problem found is the one reported."""
    path, provenance = None, None
    if isinstance(traces, (str, os.PathLike)):
        path = os.fspath(traces)
        trace_file = read_trace_file(path)
        records, provenance = trace_file.records, trace_file.provenance
    else:
        records = list(traces)
    sides = [_side(name, s) for name, s in zip("AB", (a, b))]
    if opts.trace_replay_chunk_size is not None:
        sides = [_with_option(s, "trace_replay_chunk_size", opts.trace_replay_chunk_size) for s in sides]
    _check_args(records, opts.top_k, opts.threshold, opts.batch_size)
    noise_factor = opts.noise_factor
    # inf: every |delta| is "in the noise" and the plots' axis limits become inf (matplotlib refuses them)
    if not (_is_number(noise_factor) and math.isfinite(noise_factor) and noise_factor > 0):
        raise ValueError(f"noise_factor must be a finite number > 0, got {noise_factor!r}")
    model_config = _model_config(opts.model)
    _warn_other_model(opts.model, provenance, model_config.path)
    tokenizer = _tokenizer(model_config.path)
    requests = _resolve(records, tokenizer, model_config.vocab_size, path)
    localize = opts.localize
    if isinstance(localize, bool) or not isinstance(localize, int) or localize < 0:
        raise ValueError(f"localize must be an integer >= 0, got {localize!r}")
    if localize:
        for name, spec in zip("AB", sides):
            check_localizable(name, spec)
    plan = plan_routes((sides[0], sides[1]), requests, opts.model, opts.fix_routes, localize)
    # plan.sides: an engine side of a MoE model returns its routes
    checked = tuple(check_side(name, spec, requests, opts.model, opts.top_k, opts.full_vocab)
                    for name, spec in zip("AB", plan.sides))
    if opts.full_vocab:
        check_vocab_sizes(checked, plan.sides)
    resolved = tuple(c.facts for c in checked)
    return DiffJob(plan.sides, requests, plan, resolved, tokenizer, path, provenance)


def _with_option(spec: SideSpec, name: str, value) -> SideSpec:
    """An engine side with engine option `name` defaulting to `value` (the SPEC's own value wins)."""
    if spec.kind != ENGINE or name in spec.options:
        return spec
    return SideSpec(spec.kind, {name: value, **spec.options}, spec.text)


def _check_args(records: list[TraceRecord], top_k: int, threshold: float, batch_size: int) -> None:
    if not records:
        raise TraceFileError("no traces to compare")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not (_is_number(threshold) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise TraceFileError("trace ids must be unique")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _model_config(model: str | None):
    from replayllm.config import ModelConfig
    from replayllm.embedded_model import DEFAULT_MODEL

    try:
        return ModelConfig.from_pretrained(model or DEFAULT_MODEL)
    except ValueError as e:
        short = model_not_found(model or DEFAULT_MODEL, e)
        if short is None:
            raise
        raise ValueError(f"MODEL: {short}") from e


def _warn_other_model(model: str | None, provenance: dict | None, embedded_path: str) -> None:
    """MODEL omitted: the embedded model scores the traces, which is rarely meant when the file says whose they are
    (named by its id or by its checkpoint folder: no warning)."""
    from replayllm.embedded_model import DEFAULT_MODEL

    named = (provenance or {}).get("model")
    if model is not None or not isinstance(named, str) or named == DEFAULT_MODEL:
        return
    if os.path.realpath(named) != os.path.realpath(embedded_path):
        warnings.warn(f"no MODEL given: scoring with the embedded model {DEFAULT_MODEL!r}, but the trace file's "
                      f"provenance names {named!r} (give MODEL to use it)", DiffWarning, stacklevel=3)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """The checkpoint's tokenizer (cached: loading a 150k-token vocabulary takes a second), or None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _resolve(records: list[TraceRecord], tokenizer, vocab_size: int, path: str | None) -> list[DiffRequest]:
    out = []
    for r in records:
        prompt = r.prompt_token_ids
        if prompt is None:
            if tokenizer is None:
                raise TraceFileError(f"{r.where}: has a text 'prompt' but the model has no tokenizer; "
                                     "store 'prompt_token_ids' instead")
            prompt = tokenizer.encode(r.prompt, add_special_tokens=True)  # as the engine tokenizes
            if not prompt:
                raise TraceFileError(f"{r.where}: 'prompt' tokenizes to no tokens")
        bad = [t for t in (*prompt, *r.trace_token_ids) if t >= vocab_size]
        if bad:
            raise TraceFileError(f"{_where(path, r)}: token ids outside the model's vocabulary (size {vocab_size}): "
                                 f"{bad[:8]}")
        # the `file` side reads them as alternatives: an id past the vocabulary would be reported as a flip
        for i, top in enumerate(r.top_logprobs or ()):
            bad = sorted(t for t in top if t >= vocab_size)
            if bad:
                raise TraceFileError(f"{_where(path, r)}: top_logprobs[{i}] holds token ids outside the model's "
                                     f"vocabulary (size {vocab_size}): {bad[:8]}")
        out.append(DiffRequest(r.id, list(prompt), list(r.trace_token_ids), r))
    return out


def _where(path: str | None, r: TraceRecord) -> str:
    """`traces.jsonl line 3: request 'a'`: as the reader names a line (records given in memory: no file)."""
    return f"{path} line {r.line}: request {r.id!r}" if path is not None and r.line is not None else r.where


def _side(name: str, spec: str | SideSpec) -> SideSpec:
    """A SPEC string parsed (its errors name the side), or a SideSpec as given."""
    if isinstance(spec, SideSpec):
        return spec
    try:
        return parse_spec(spec)
    except SpecError as e:
        raise SpecError(f"side {name} ({spec!r}): {str(e).removeprefix(f'SPEC {spec!r}: ')}") from None
