"""Typed diff results: one TokenDiff per scored position, DiffStats per request and overall, the DiffResult."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .routing import RoutingDiff
from .spec import SideSpec


@dataclass(frozen=True)
class TokenDiff:
    """One trace position scored by both sides. Δ = B − A."""

    request_id: str
    position: int  # 0-based index into the trace (the completion), not into prompt + trace
    token: int  # the trace token both sides scored
    text: str | None  # its text (None when the model has no tokenizer)
    logprob_a: float
    logprob_b: float
    rank_a: int | None  # tokens with a logprob >= its own (vLLM's; None: the side has no ranks, `file`)
    rank_b: int | None
    top1_a: int | None  # the side's most likely token here (None: no top-k from that side)
    top1_b: int | None
    kl: float  # KL(A‖B) at this position; DiffResult.kl_method says exact or top-k estimate
    # Each side's top-k alternatives here, ((token, logprob), ...) most likely first (empty: none reported).
    top_a: tuple[tuple[int, float], ...] = ()
    top_b: tuple[tuple[int, float], ...] = ()

    @property
    def delta(self) -> float:
        return self.logprob_b - self.logprob_a

    @property
    def argmax_agree(self) -> bool | None:
        """Both sides' top-1 the same token; an exact tie on either side counts as agreement (that side's top-1 is
        either token: two tie-breaks of one distribution, no flip)."""
        if self.top1_a is None or self.top1_b is None:
            return None
        if self.top1_a == self.top1_b:
            return True
        return (_tied(self.top_a, self.token, self.logprob_a, self.top1_a, self.top1_b)
                or _tied(self.top_b, self.token, self.logprob_b, self.top1_b, self.top1_a))


def _tied(top: tuple[tuple[int, float], ...], token: int, logprob: float, top1: int, other: int) -> bool:
    """Whether `other` has exactly the side's top-1 logprob (what the side reported: its top-k and the trace token)."""
    known = dict(top)
    known[token] = logprob
    return other in known and top1 in known and known[other] == known[top1]


@dataclass(frozen=True)
class DiffStats:
    """Summary of a set of TokenDiffs (one request's, or all of them)."""

    num_tokens: int
    mean_delta: float  # signed: > 0 when B is more confident in the trace than A on average
    mean_abs_delta: float
    max_abs_delta: float
    p50_abs_delta: float
    p90_abs_delta: float
    p99_abs_delta: float
    argmax_agreement: float | None  # share of positions where both top-1 tokens are equal (None: unknown)
    mean_kl: float
    max_kl: float
    first_divergence: int | None  # first position with |Δ| > threshold (overall: the earliest of all requests)
    first_divergence_request: str | None  # the request it belongs to
    num_diverged_requests: int  # requests with at least one |Δ| > threshold
    num_flips: int | None = 0  # positions where the two sides' top-1 tokens differ (None: unknown, no top-k)
    first_flip: int | None = None  # the first such position (overall: the earliest of all requests)
    first_flip_request: str | None = None
    first_above_noise: int | None = None  # the first position with |Δ| > the run's noise threshold
    first_above_noise_request: str | None = None

    @classmethod
    def of(cls, tokens: list[TokenDiff], threshold: float, noise_threshold: float | None = None) -> DiffStats:
        delta = np.array([t.delta for t in tokens], dtype=np.float64)
        abs_delta = np.abs(delta)
        kl = np.array([t.kl for t in tokens], dtype=np.float64)
        agree = [a for a in (t.argmax_agree for t in tokens) if a is not None]
        p50, p90, p99 = np.percentile(abs_delta, [50, 90, 99])
        over = [t for t in tokens if abs(t.delta) > threshold]
        first = _earliest(over)
        flip = _earliest([t for t in tokens if t.argmax_agree is False])
        noisy = None if noise_threshold is None else _earliest([t for t in tokens if abs(t.delta) > noise_threshold])
        return cls(
            num_tokens=len(tokens),
            mean_delta=float(delta.mean()),
            mean_abs_delta=float(abs_delta.mean()),
            max_abs_delta=float(abs_delta.max()),
            p50_abs_delta=float(p50),
            p90_abs_delta=float(p90),
            p99_abs_delta=float(p99),
            argmax_agreement=sum(agree) / len(agree) if agree else None,
            mean_kl=float(kl.mean()),
            max_kl=float(kl.max()),
            first_divergence=None if first is None else first.position,
            first_divergence_request=None if first is None else first.request_id,
            num_diverged_requests=len({t.request_id for t in over}),
            num_flips=sum(t.argmax_agree is False for t in tokens) if agree else None,
            first_flip=None if flip is None else flip.position,
            first_flip_request=None if flip is None else flip.request_id,
            first_above_noise=None if noisy is None else noisy.position,
            first_above_noise_request=None if noisy is None else noisy.request_id,
        )


def _earliest(tokens: list[TokenDiff]) -> TokenDiff | None:
    """The token at the smallest position (min keeps the earliest request on ties), or None."""
    return min(tokens, key=lambda t: t.position) if tokens else None


def noise_threshold(tokens: list[TokenDiff], factor: float) -> float:
    """factor × the median |Δ| of the run: the level above which a position stands out of the run's own noise
    (0 when at least half the positions are bit-identical, so then any nonzero |Δ| stands out)."""
    return float(factor * np.median(np.abs([t.delta for t in tokens])))


@dataclass(frozen=True)
class Flip:
    """A position where the two sides' most likely tokens differ: where free sampling would part ways."""

    request_id: str
    position: int
    token: int  # the trace token at this position
    text: str | None
    top1_a: int
    top1_b: int
    top1_text_a: str | None  # None without a tokenizer (the report then shows ids)
    top1_text_b: str | None
    rank_a: int | None  # the trace token's rank on each side
    rank_b: int | None
    delta: float  # of the trace token's logprob, B − A


@dataclass(frozen=True)
class RequestDiff:
    request_id: str
    tokens: list[TokenDiff]  # one per trace position, in order
    stats: DiffStats


@dataclass(frozen=True)
class LayerDiff:
    """The relative difference ‖a − b‖ / ‖a‖ of one checkpoint over the examined positions."""

    name: str  # "embedding", "layer 3 attention", "layer 3 mlp", "final norm", "logits"
    layer: int | None  # decoder layer index (None: embedding, final norm, logits)
    part: str  # "embedding" | "attention" | "mlp" | "final norm" | "logits"
    rel_diff: float


@dataclass(frozen=True)
class Localization:
    positions: list[tuple[str, int]]  # the (request, trace position) pairs examined, in the order chosen
    checkpoints: list[LayerDiff]  # in forward order
    first_jump: LayerDiff | None  # the first checkpoint whose difference jumps above the earlier floor
    jump_factor: float  # a jump: rel_diff > max(jump_factor × the largest earlier rel_diff, min_jump)
    min_jump: float


@dataclass(frozen=True)
class DiffResult:
    """What `compare` returns; `report.write_report` turns it into JSON, Markdown and plots."""

    model: str  # the model both sides default to (a SPEC's model=... may override it)
    a: SideSpec
    b: SideSpec
    traces: str | None  # the trace file, when read from one
    top_k: int
    full_vocab: bool
    threshold: float  # |Δ| above this counts as a divergence
    kl_method: str  # "exact (full vocabulary)" or "top-k estimate (k=...)"
    requests: list[RequestDiff]
    overall: DiffStats
    seconds_a: float  # wall time of each side (engine start-up included)
    seconds_b: float
    noise_factor: float = 10.0  # noise_threshold = noise_factor × median |Δ| of the run
    noise_threshold: float = 0.0
    flips: list[Flip] = field(default_factory=list)  # every argmax flip, in trace order
    resolved_a: dict[str, Any] = field(default_factory=dict)  # what each side resolved to (resolved.py)
    resolved_b: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str | None] = field(default_factory=dict)  # of the diff's own run
    provenance: dict[str, Any] | None = None  # the trace file's capture provenance (None: not recorded)
    localization: Localization | None = None  # compare(localize=N > 0) only
    routing: RoutingDiff | None = None  # MoE models only: the sides' router agreement (None: a dense model)
    # The text of every token id the result names (trace tokens, top-1s, top-k alternatives); empty (or None
    # values) without a tokenizer. The HTML report and the export read token text from here.
    token_texts: dict[int, str | None] = field(default_factory=dict)

    @property
    def tokens(self) -> list[TokenDiff]:
        return [t for r in self.requests for t in r.tokens]

    @property
    def max_abs_delta(self) -> float:
        return self.overall.max_abs_delta

    def worst(self, n: int = 10) -> list[TokenDiff]:
        """The n positions with the largest |Δ| (largest first)."""
        return sorted(self.tokens, key=lambda t: abs(t.delta), reverse=True)[:n]
