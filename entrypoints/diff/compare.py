"""compare(): validate everything, run side A, run side B, and diff them position by position."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..distributed.options import ScaleOut
from .job import DiffJob, DiffOptions, prepare_job
from .kl import EXACT, exact_kl, topk_kl, topk_method
from .localize import localize as run_localize
from .localize import pick_positions
from .resolved import versions
from .results import DiffResult, DiffStats, Flip, RequestDiff, TokenDiff, noise_threshold
from .route_plan import RoutePlan
from .routing import RoutingDiff, not_compared, routing_diff
from .sides import DiffRequest, SideScores, run_side
from .spec import ENGINE, SideSpec
from .trace_file import TraceRecord

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
    requests per shard (replayllm.entrypoints.distributed; `hf` and `file` sides run here as before).
    MoE models: both sides' routes are compared (DiffResult.routing, routing.py); fix_routes "a" replays side
    A's routes on side B ("b": B's on A, and B runs first; route_plan.py). Everything is validated before
    anything runs: a bad SPEC, trace or option raises ValueError (SpecError / TraceFileError) without having
    spent time on side A.
    """
    opts = DiffOptions(model=model, full_vocab=full_vocab, top_k=top_k, threshold=threshold, batch_size=batch_size,
                       noise_factor=noise_factor, localize=localize, trace_replay_chunk_size=trace_replay_chunk_size,
                       progress=progress, scale_out=ScaleOut(data_parallel_size, ray_address), fix_routes=fix_routes)
    job = prepare_job(traces, a, b, opts)
    return _result(job, _score_sides(job, opts), opts)


@dataclass
class _Scored:
    """Both sides' run over every request: per request its position-by-position diff, per side its routes."""

    texts: _TokenText  # token id -> text, shared with the result (each id decoded once)
    per_request: list[list[TokenDiff]] = field(default_factory=list)
    # per side, per request: [prompt + trace - 1, L, k] routes or None
    routes: tuple[list, list] = field(default_factory=lambda: ([], []))
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])  # per side (A, B)
    k_seen: list[int] = field(default_factory=list)  # alternatives reported at every position, per side's request


def _score_sides(job: DiffJob, opts: DiffOptions) -> _Scored:
    """Run the first side over every request (its full-vocabulary rows parked in a memory-mapped file), then the
    second, diffing each request as its second scores arrive."""
    run = dict(model=opts.model, top_k=opts.top_k, full_vocab=opts.full_vocab, batch_size=opts.batch_size,
               scale_out=opts.scale_out)
    sides, requests = job.sides, job.requests
    first, second = job.plan.first, 1 - job.plan.first  # A then B, unless B's routes are to be replayed on A
    scored = _Scored(_TokenText(job.tokenizer))
    with tempfile.TemporaryDirectory(prefix="replayllm-diff-") as tmp:
        t0 = time.perf_counter()
        store = _RowStore(tmp, sum(len(r.trace_token_ids) for r in requests)) if opts.full_vocab else None
        with _bar(opts.progress, len(requests), f"{'AB'[first]} {sides[first]}") as bar:
            scores_1 = [store.keep(s) if store else s for s in
                        _run_side(sides[first], requests, on_request=bar.update, facts=job.resolved[first], **run)]
        scored.seconds[first] = time.perf_counter() - t0

        t0 = time.perf_counter()
        scored.k_seen = [_known_k(s.top) for s in scores_1]
        with _bar(opts.progress, len(requests), f"{'AB'[second]} {sides[second]}") as bar:
            # The side's generator goes first in zip: it runs to its end, so its engine is freed right there.
            side_2 = _run_side(sides[second], job.plan.forced(requests, scores_1), on_request=bar.update,
                               facts=job.resolved[second], **run)
            for s2, req, s1 in zip(side_2, requests, scores_1):
                sa, sb = (s1, s2) if first == 0 else (s2, s1)
                scored.per_request.append(_diff_request(req, sa, sb, opts.full_vocab, scored.texts))
                scored.k_seen.append(_known_k(s2.top))
                scored.routes[0].append(sa.routes)
                scored.routes[1].append(sb.routes)
        scored.seconds[second] = time.perf_counter() - t0
        scores_1 = store = s1 = sa = sb = None  # release the first side's rows (memory-mapped) before the folder goes
    return scored


def _result(job: DiffJob, scored: _Scored, opts: DiffOptions) -> DiffResult:
    """The statistics over every position, the flips, the localization (localize > 0) and the routing."""
    all_tokens = [t for tokens in scored.per_request for t in tokens]
    noise = noise_threshold(all_tokens, opts.noise_factor)
    diffs = [RequestDiff(req.id, tokens, DiffStats.of(tokens, opts.threshold, noise))
             for req, tokens in zip(job.requests, scored.per_request)]
    located = None
    if opts.localize:
        located = run_localize(job.sides, job.requests, pick_positions(all_tokens, opts.localize), opts.model)
    texts, (side_a, side_b) = scored.texts, job.sides
    return DiffResult(model=_model_name(opts.model), a=side_a, b=side_b, traces=job.path, top_k=opts.top_k,
                      full_vocab=opts.full_vocab, threshold=opts.threshold,
                      kl_method=EXACT if opts.full_vocab else topk_method(min(scored.k_seen)), requests=diffs,
                      overall=DiffStats.of(all_tokens, opts.threshold, noise), seconds_a=scored.seconds[0],
                      seconds_b=scored.seconds[1], noise_factor=float(opts.noise_factor), noise_threshold=noise,
                      flips=[_flip(t, texts) for t in all_tokens if t.argmax_agree is False],
                      resolved_a=job.resolved[0], resolved_b=job.resolved[1], versions=versions(),
                      provenance=job.provenance, localization=located, token_texts=_named_texts(all_tokens, texts),
                      routing=_routing(job.plan, job.requests, scored.routes))


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
