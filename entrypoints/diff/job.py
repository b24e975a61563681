"""DiffJob: what compare()'s traces, sides and options (DiffOptions) resolve to, validated before any side runs."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..distributed.options import ScaleOut
from .localize import check_localizable
from .resolved import engine_resolved, hf_resolved
from .route_plan import RoutePlan, plan_routes
from .sides import DiffRequest, hf_settings
from .spec import ENGINE, FILE, HF, SideSpec, SpecError, engine_kwargs, parse_spec
from .trace_file import TraceFileError, TraceRecord, read_trace_file


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
    if not (isinstance(noise_factor, (int, float)) and not isinstance(noise_factor, bool) and noise_factor > 0):
        raise ValueError(f"noise_factor must be a number > 0, got {noise_factor!r}")
    model_config = _model_config(opts.model)
    tokenizer = _tokenizer(model_config.path)
    requests = _resolve(records, tokenizer, model_config.vocab_size)
    localize = opts.localize
    if isinstance(localize, bool) or not isinstance(localize, int) or localize < 0:
        raise ValueError(f"localize must be an integer >= 0, got {localize!r}")
    if localize:
        for name, spec in zip("AB", sides):
            check_localizable(name, spec)
    plan = plan_routes((sides[0], sides[1]), requests, opts.model, opts.fix_routes, localize)
    # plan.sides: an engine side of a MoE model returns its routes
    resolved = tuple(_check_side(name, spec, requests, opts.model, opts.top_k, opts.full_vocab)
                     for name, spec in zip("AB", plan.sides))
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
    if not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    ids = [r.id for r in records]
    if len(set(ids)) != len(ids):
        raise TraceFileError("trace ids must be unique")


def _model_config(model: str | None):
    from replayllm.config import ModelConfig
    from replayllm.embedded_model import DEFAULT_MODEL

    return ModelConfig.from_pretrained(model or DEFAULT_MODEL)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str):
    """The checkpoint's tokenizer (cached: loading a 150k-token vocabulary takes a second), or None."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _resolve(records: list[TraceRecord], tokenizer, vocab_size: int) -> list[DiffRequest]:
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
            raise TraceFileError(f"{r.where}: token ids outside the model's vocabulary (size {vocab_size}): {bad[:8]}")
        out.append(DiffRequest(r.id, list(prompt), list(r.trace_token_ids), r))
    return out


def _side(name: str, spec: str | SideSpec) -> SideSpec:
    """A SPEC string parsed (its errors name the side), or a SideSpec as given."""
    if isinstance(spec, SideSpec):
        return spec
    try:
        return parse_spec(spec)
    except SpecError as e:
        raise SpecError(f"side {name} ({spec!r}): {str(e).removeprefix(f'SPEC {spec!r}: ')}") from None


def _check_side(name: str, spec: SideSpec, requests: list[DiffRequest], model: str | None, top_k: int,
                full_vocab: bool) -> dict:
    """Validate one side against the traces; return what it resolved to (resolved.py)."""
    where = f"side {name} ({spec.text!r})"
    if spec.kind == FILE:
        if full_vocab:
            raise SpecError(f"{where}: --full-vocab needs both sides to compute whole distributions; a trace "
                            "file stores only per-token logprobs (drop --full-vocab for a top-k KL estimate)")
        missing = [r.record.where for r in requests if r.record.logprobs is None]
        if missing:
            raise TraceFileError(f"{where}: the 'file' side reads stored 'logprobs', which {missing[0]} lacks"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return {"source": "the trace file's stored logprobs (see the trace file's provenance)"}
    try:
        if spec.kind == ENGINE:
            from replayllm.config import EngineConfig

            config = EngineConfig(**engine_kwargs(spec, model, top_k))
            limit, what, vocab = config.max_model_len, "max_model_len", config.model_config.vocab_size
            facts = engine_resolved(config)
        elif spec.kind == HF:
            mc, device = hf_settings(spec, model)
            limit, what, vocab = mc.max_position_embeddings, "max_position_embeddings", mc.vocab_size
            facts = hf_resolved(mc, device, spec.options.get("attn_implementation"))
        else:
            raise SpecError(f"{where}: unknown kind {spec.kind!r}")
    except (TypeError, ValueError) as e:
        if isinstance(e, SpecError):
            raise
        raise SpecError(f"{where}: {e}") from e
    for r in requests:
        n = len(r.prompt_token_ids) + len(r.trace_token_ids)
        if n > limit:
            raise TraceFileError(f"{r.record.where}: prompt + trace = {n} tokens exceed {what}={limit} of {where}")
        bad = [t for t in (*r.prompt_token_ids, *r.trace_token_ids) if t >= vocab]
        if bad:
            raise TraceFileError(f"{r.record.where}: token ids outside the vocabulary (size {vocab}) of {where}")
    return facts
