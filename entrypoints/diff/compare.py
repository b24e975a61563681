"""compare(): validate everything, run side A, run side B, and diff them position by position."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Iterator, Sequence

import numpy as np

from ..distributed.options import ScaleOut
from .kl import EXACT, exact_kl, topk_kl, topk_method
from .localize import check_localizable, pick_positions
from .localize import localize as run_localize
from .resolved import engine_resolved, hf_resolved, versions
from .results import DiffResult, DiffStats, Flip, RequestDiff, TokenDiff, noise_threshold
from .route_plan import RoutePlan, plan_routes
from .routing import RoutingDiff, not_compared, routing_diff
from .sides import DiffRequest, SideScores, hf_settings, run_side
from .spec import ENGINE, FILE, HF, SideSpec, SpecError, engine_kwargs, parse_spec
from .trace_file import TraceFileError, TraceRecord, read_trace_file

__all__ = ["DiffResult", "DiffStats", "RequestDiff", "TokenDiff", "compare"]


def compare(traces: str | os.PathLike | Sequence[TraceRecord], a: str | SideSpec, b: str | SideSpec, *,
            model: str | None = None, full_vocab: bool = False, top_k: int = 20, threshold: float = 1e-3,
            batch_size: int = 32, noise_factor: float = 10.0, localize: int = 0,
            trace_replay_chunk_size: int | None = None, progress: bool = False, data_parallel_size: int = 1,
            ray_address: str | None = None, fix_routes: str | None = None) -> DiffResult:
    """Score every trace on side A, then on side B (one engine at a time, freed in between), and diff them.

    traces: a trace file path or TraceRecords. a, b: SPEC strings (see spec.parse_spec) or SideSpecs.
    model: checkpoint both sides default to (None: the embedded model). full_vocab: both sides keep their
    whole distribution per position, for an exact KL (else a top-k estimate). top_k: alternatives read per
    position (argmax agreement needs >= 1). threshold: |Δ| above it is a divergence. batch_size: requests per
    engine batch. noise_factor: a position stands out of the run's noise when its |Δ| exceeds noise_factor ×
    the run's median |Δ| (DiffStats.first_above_noise). localize: at most this many positions (argmax flips
    first, then the largest |Δ|) are run again on both sides with hooks on every decoder layer, and the first
    layer where they part is named (localize.py; 0: off). trace_replay_chunk_size: the engine option for both
    engine sides unless a SPEC sets its own (None: the engine's default, one token per step
    or fast replay in batch-invariant mode; K > 1: fast replay).
    data_parallel_size > 1 or a ray_address: each engine side runs on that many Ray replicas, batch_size
    requests per shard (replayllm.distributed; `hf` and `file` sides run here as before).
    MoE models: both sides' routes are compared (DiffResult.routing, routing.py); fix_routes "a" replays side
    A's routes on side B ("b": B's on A, and B runs first; route_plan.py). Everything is validated before
    anything runs: a bad SPEC, trace or option raises ValueError (SpecError / TraceFileError) without having
    spent time on side A.
    """
    scale_out = ScaleOut(data_parallel_size, ray_address)
    path, provenance = None, None
    if isinstance(traces, (str, os.PathLike)):
        path = os.fspath(traces)
        trace_file = read_trace_file(path)
        records, provenance = trace_file.records, trace_file.provenance
    else:
        records = list(traces)
    sides = [_side(name, s) for name, s in zip("AB", (a, b))]
    if trace_replay_chunk_size is not None:
        sides = [_with_option(s, "trace_replay_chunk_size", trace_replay_chunk_size) for s in sides]
    _check_args(records, top_k, threshold, batch_size)
    if not (isinstance(noise_factor, (int, float)) and not isinstance(noise_factor, bool) and noise_factor > 0):
        raise ValueError(f"noise_factor must be a number > 0, got {noise_factor!r}")
    model_config = _model_config(model)
    tokenizer = _tokenizer(model_config.path)
    requests = _resolve(records, tokenizer, model_config.vocab_size)
    if isinstance(localize, bool) or not isinstance(localize, int) or localize < 0:
        raise ValueError(f"localize must be an integer >= 0, got {localize!r}")
    if localize:
        for name, spec in zip("AB", sides):
            check_localizable(name, spec)
    plan = plan_routes((sides[0], sides[1]), requests, model, fix_routes, localize)
    sides = list(plan.sides)  # an engine side of a MoE model returns its routes
    resolved = [_check_side(name, spec, requests, model, top_k, full_vocab) for name, spec in zip("AB", sides)]

    run = dict(model=model, top_k=top_k, full_vocab=full_vocab, batch_size=batch_size, scale_out=scale_out)
    first, second = plan.first, 1 - plan.first  # A then B, unless B's routes are to be replayed on A
    seconds = [0.0, 0.0]
    routes: list[list] = [[], []]  # per side, per request: [prompt + trace - 1, L, k] routes or None
    with tempfile.TemporaryDirectory(prefix="replayllm-diff-") as tmp:
        t0 = time.perf_counter()
        store = _RowStore(tmp, sum(len(r.trace_token_ids) for r in requests)) if full_vocab else None
        with _bar(progress, len(requests), f"{'AB'[first]} {sides[first]}") as bar:
            scores_1 = [store.keep(s) if store else s for s in
                        _run_side(sides[first], requests, on_request=bar.update, facts=resolved[first], **run)]
        seconds[first] = time.perf_counter() - t0

        t0 = time.perf_counter()
        per_request: list[list[TokenDiff]] = []
        k_seen = [_known_k(s.top) for s in scores_1]
        texts = _TokenText(tokenizer)
        with _bar(progress, len(requests), f"{'AB'[second]} {sides[second]}") as bar:
            # The side's generator goes first in zip: it runs to its end, so its engine is freed right there.
            side_2 = _run_side(sides[second], plan.forced(requests, scores_1), on_request=bar.update,
                               facts=resolved[second], **run)
            for s2, req, s1 in zip(side_2, requests, scores_1):
                sa, sb = (s1, s2) if first == 0 else (s2, s1)
                per_request.append(_diff_request(req, sa, sb, full_vocab, texts))
                k_seen.append(_known_k(s2.top))
                routes[0].append(sa.routes)
                routes[1].append(sb.routes)
        seconds[second] = time.perf_counter() - t0
        scores_1 = store = s1 = sa = sb = None  # release the first side's rows (memory-mapped) before the folder goes

    all_tokens = [t for tokens in per_request for t in tokens]
    noise = noise_threshold(all_tokens, noise_factor)
    diffs = [RequestDiff(req.id, tokens, DiffStats.of(tokens, threshold, noise))
             for req, tokens in zip(requests, per_request)]
    located = None
    if localize:
        located = run_localize((sides[0], sides[1]), requests, pick_positions(all_tokens, localize), model)
    return DiffResult(model=_model_name(model), a=sides[0], b=sides[1], traces=path, top_k=top_k,
                      full_vocab=full_vocab, threshold=threshold,
                      kl_method=EXACT if full_vocab else topk_method(min(k_seen)), requests=diffs,
                      overall=DiffStats.of(all_tokens, threshold, noise), seconds_a=seconds[0], seconds_b=seconds[1],
                      noise_factor=float(noise_factor), noise_threshold=noise,
                      flips=[_flip(t, texts) for t in all_tokens if t.argmax_agree is False],
                      resolved_a=resolved[0], resolved_b=resolved[1], versions=versions(),
                      provenance=provenance, localization=located, token_texts=_named_texts(all_tokens, texts),
                      routing=_routing(plan, requests, routes))


def _routing(plan: RoutePlan, requests: list[DiffRequest], routes: list[list]) -> RoutingDiff | None:
    """The router agreement (None for a dense model: no routing section at all)."""
    if not plan.reported:
        return None
    reason = plan.comparable
    if reason is None and any(r is None for side in routes for r in side):
        reason = "a side returned no routes for some request"
    if reason is not None:
        return not_compared(reason, plan.fix)
    return routing_diff([r.id for r in requests], [len(r.prompt_token_ids) for r in requests], routes[0], routes[1],
                        plan.fix)


def _run_side(spec: SideSpec, requests: list[DiffRequest], *, scale_out: ScaleOut, **run) -> Iterator[SideScores]:
    """run_side, or for an engine side under data parallelism, its replicas' scores (merged in order)."""
    if spec.kind == ENGINE and scale_out.uses_ray:
        from ..distributed.sharded import score_side

        run.pop("facts")
        return iter(score_side(spec, requests, scale_out, **run))
    return run_side(spec, requests, **run)


def _flip(t: TokenDiff, texts: _TokenText) -> Flip:
    return Flip(request_id=t.request_id, position=t.position, token=t.token, text=t.text, top1_a=t.top1_a,
                top1_b=t.top1_b, top1_text_a=texts(t.top1_a), top1_text_b=texts(t.top1_b), rank_a=t.rank_a,
                rank_b=t.rank_b, delta=t.delta)


def _named_texts(tokens: list[TokenDiff], texts: _TokenText) -> dict[int, str | None]:
    """token id -> text for every id the result names (each decoded once)."""
    ids = {i for t in tokens for i in (t.token, t.top1_a, t.top1_b) if i is not None}
    ids.update(i for t in tokens for i, _ in (*t.top_a, *t.top_b))
    return {i: texts(i) for i in sorted(ids)}


def _model_name(model: str | None) -> str:
    from replayllm.embedded_model import DEFAULT_MODEL

    return model or DEFAULT_MODEL


def _diff_request(req: DiffRequest, sa: SideScores, sb: SideScores, full_vocab: bool,
                  texts: _TokenText) -> list[TokenDiff]:
    n = len(req.trace_token_ids)
    if full_vocab:
        kl = exact_kl(sa.full, sb.full)
    else:
        kl = [topk_kl(_known(sa, i, t), _known(sb, i, t)) for i, t in enumerate(req.trace_token_ids)]
    return [TokenDiff(request_id=req.id, position=i, token=t, text=texts(t),
                      logprob_a=float(sa.logprobs[i]), logprob_b=float(sb.logprobs[i]),
                      rank_a=_rank(sa, i), rank_b=_rank(sb, i), top1_a=_top1(sa, i, t), top1_b=_top1(sb, i, t),
                      kl=float(kl[i]), top_a=_top(sa, i), top_b=_top(sb, i))
            for i, t in zip(range(n), req.trace_token_ids)]


def _known(s: SideScores, i: int, token: int) -> dict[int, float]:
    """Everything a side reported at position i: its top-k plus the trace token."""
    known = dict(s.top[i]) if s.top is not None else {}
    known[token] = float(s.logprobs[i])
    return known


def _top(s: SideScores, i: int) -> tuple[tuple[int, float], ...]:
    """The side's reported top-k at position i, most likely first (ties: the smaller token id first)."""
    if s.top is None:
        return ()
    return tuple(sorted(((int(t), float(lp)) for t, lp in s.top[i].items()), key=lambda kv: (-kv[1], kv[0])))


def _rank(s: SideScores, i: int) -> int | None:
    return None if s.ranks is None else int(s.ranks[i])


def _top1(s: SideScores, i: int, token: int) -> int | None:
    if s.top is not None and s.top[i]:
        known = _known(s, i, token)
        return max(known, key=known.__getitem__)
    if s.full is not None:
        return int(np.argmax(s.full[i]))
    return None


def _known_k(top: list[dict[int, float]] | None) -> int:
    """The number of alternatives a side reported at every position (0 when none)."""
    return min((len(d) for d in top), default=0) if top is not None else 0


# -- validation (before anything runs) ---------------------------------------------------------------------
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


# -- helpers -----------------------------------------------------------------------------------------------
class _TokenText:
    """token id -> its text, decoded once per distinct token (None without a tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str | None] = {}

    def __call__(self, token: int) -> str | None:
        if token not in self.cache:
            self.cache[token] = None if self.tokenizer is None else self.tokenizer.decode([token])
        return self.cache[token]


class _RowStore:
    """Side A's full-vocabulary rows, parked in a memory-mapped temporary file while side B runs
    (n_tokens x V x 4 bytes: they need not fit in memory)."""

    def __init__(self, directory: str, num_rows: int):
        self.directory, self.num_rows, self.used = directory, num_rows, 0
        self.rows: np.memmap | None = None

    def keep(self, scores: SideScores) -> SideScores:
        full = scores.full
        if self.rows is None:
            self.rows = np.lib.format.open_memmap(os.path.join(self.directory, "rows_a.npy"), mode="w+",
                                                  dtype=np.float32, shape=(self.num_rows, full.shape[1]))
        view = self.rows[self.used : self.used + full.shape[0]]
        view[:] = full
        self.used += full.shape[0]
        scores.full = view
        return scores


class _bar:
    """A tqdm progress bar over requests (a no-op when progress is off)."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self.tqdm = None
        if enabled:
            from tqdm.auto import tqdm

            self.tqdm = tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True)

    def update(self) -> None:
        if self.tqdm is not None:
            self.tqdm.update(1)

    def __enter__(self) -> _bar:
        return self

    def __exit__(self, *exc) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
