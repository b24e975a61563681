"""Typed diff results: one TokenDiff per scored position, DiffStats per request and overall, the DiffResult."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    rank_a: int | None  # 1 + tokens with a strictly larger logprob (None: the side has no ranks, `file`)
    rank_b: int | None
    top1_a: int | None  # the side's most likely token here (None: no top-k from that side)
    top1_b: int | None
    kl: float  # KL(A‖B) at this position; DiffResult.kl_method says exact or top-k estimate

    @property
    def delta(self) -> float:
        return self.logprob_b - self.logprob_a

    @property
    def argmax_agree(self) -> bool | None:
        if self.top1_a is None or self.top1_b is None:
            return None
        return self.top1_a == self.top1_b


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

    @classmethod
    def of(cls, tokens: list[TokenDiff], threshold: float) -> DiffStats:
        delta = np.array([t.delta for t in tokens], dtype=np.float64)
        abs_delta = np.abs(delta)
        kl = np.array([t.kl for t in tokens], dtype=np.float64)
        agree = [a for a in (t.argmax_agree for t in tokens) if a is not None]
        p50, p90, p99 = np.percentile(abs_delta, [50, 90, 99])
        over = [t for t in tokens if abs(t.delta) > threshold]
        first = min(over, key=lambda t: t.position) if over else None  # min keeps the earliest request on ties
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
        )


@dataclass(frozen=True)
class RequestDiff:
    request_id: str
    tokens: list[TokenDiff]  # one per trace position, in order
    stats: DiffStats


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

    @property
    def tokens(self) -> list[TokenDiff]:
        return [t for r in self.requests for t in r.tokens]

    @property
    def max_abs_delta(self) -> float:
        return self.overall.max_abs_delta

    def worst(self, n: int = 10) -> list[TokenDiff]:
        """The n positions with the largest |Δ| (largest first)."""
        return sorted(self.tokens, key=lambda t: abs(t.delta), reverse=True)[:n]
