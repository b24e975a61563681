"""Router agreement of a MoE model between the two sides: per sparse layer, overall, per request, and where the
routes first part. Routes are CompletionOutput.routed_experts' layout: [len(prompt) + len(trace) - 1, num_layers,
top_k] expert ids per request, -1 on a dense layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class LayerAgreement:
    layer: int  # decoder layer index (sparse layers only)
    agreement: float  # share of routed positions whose top-k expert sets are equal on both sides


@dataclass(frozen=True)
class RoutePart:
    """Where the two sides' routes first part: the first request (file order) with a parting, its first position,
    the lowest layer there."""

    request_id: str
    position: int  # 0-based over prompt + trace: the token this row routed (the row of routed_experts)
    # The trace position whose logprob this forward computes, position - len(prompt) + 1 (None: a prompt position
    # before the prompt's last token, whose forward scores no trace token).
    trace_position: int | None
    layer: int
    experts_a: tuple[int, ...]  # each side's experts there, in its own order (most probable first)
    experts_b: tuple[int, ...]


@dataclass(frozen=True)
class RequestRouting:
    request_id: str
    agreement: float  # over this request's (position, sparse layer) pairs
    first_parting: int | None  # its first position (over prompt + trace) where a layer's sets differ; None: none


@dataclass(frozen=True)
class RoutingDiff:
    """The routing section of a diff (MoE models only). `compared` False: a side had no routes (`note` says why)
    and the numbers are empty."""

    compared: bool
    note: str | None = None  # why the routes were not compared
    fixed: str | None = None  # "a": side A's routes were forced on side B (--fix-routes a); "b": B's on A
    top_k: int = 0
    sparse_layers: tuple[int, ...] = ()
    num_positions: int = 0  # routed positions over all requests (prompt + trace - 1 each)
    agreement: float | None = None  # over every (position, sparse layer) pair
    position_agreement: float | None = None  # share of positions where every sparse layer agrees
    layers: list[LayerAgreement] = field(default_factory=list)
    requests: list[RequestRouting] = field(default_factory=list)
    first_parting: RoutePart | None = None
    # Each side's routes per request, [len(prompt) + len(trace) - 1, num_layers, top_k] int16 (Python API only:
    # not in diff.json; with --fix-routes the forced side's are what its engine captured while forced).
    routes_a: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)
    routes_b: list[np.ndarray] = field(default_factory=list, repr=False, compare=False)

    @property
    def forced_side(self) -> str | None:
        return None if self.fixed is None else ("b" if self.fixed == "a" else "a")


def not_compared(note: str, fixed: str | None = None) -> RoutingDiff:
    return RoutingDiff(compared=False, note=note, fixed=fixed)


def routing_diff(request_ids: Sequence[str], prompt_lens: Sequence[int], routes_a: Sequence[np.ndarray],
                 routes_b: Sequence[np.ndarray], fixed: str | None = None) -> RoutingDiff:
    """Compare the routes of every request ([R_i, L, k] int arrays, both sides the same shape). A layer counts as
    sparse when either side routes any token on it (a dense layer's rows are all -1 on both)."""
    for rid, a, b in zip(request_ids, routes_a, routes_b):
        if a.shape != b.shape:
            raise ValueError(f"request {rid!r}: the sides' routes have different shapes {a.shape} and {b.shape}")
    sparse = np.zeros(routes_a[0].shape[1], dtype=bool)  # [L]
    for a, b in zip(routes_a, routes_b):
        sparse |= (a >= 0).any(axis=(0, 2)) | (b >= 0).any(axis=(0, 2))
    layers = np.flatnonzero(sparse)
    if layers.size == 0:
        return not_compared("no layer routes any token on either side (a dense model's routes)", fixed)
    same_per_layer = np.zeros(layers.size, dtype=np.int64)  # [L_sparse] positions whose sets agree
    rows = same_rows = 0
    per_request, first = [], None
    for rid, plen, a, b in zip(request_ids, prompt_lens, routes_a, routes_b):
        # Order-insensitive: sort each (position, layer)'s k ids, then compare. [R, L_sparse]
        same = (np.sort(a[:, layers], axis=-1) == np.sort(b[:, layers], axis=-1)).all(axis=-1)
        same_per_layer += same.sum(axis=0)
        rows += same.shape[0]
        same_rows += int(same.all(axis=1).sum())
        parted = np.argwhere(~same)  # [m, 2] (position, sparse-layer index), position-major
        first_pos = int(parted[0, 0]) if parted.size else None
        per_request.append(RequestRouting(rid, float(same.mean()), first_pos))
        if first is None and first_pos is not None:
            pos, li = (int(x) for x in parted[0])
            layer = int(layers[li])
            scored = pos - plen + 1
            first = RoutePart(rid, pos, scored if scored >= 0 else None, layer,
                              tuple(int(e) for e in a[pos, layer]), tuple(int(e) for e in b[pos, layer]))
    return RoutingDiff(
        compared=True, fixed=fixed, top_k=int(routes_a[0].shape[2]), sparse_layers=tuple(int(x) for x in layers),
        num_positions=rows, agreement=float(same_per_layer.sum() / (rows * layers.size)),
        position_agreement=same_rows / rows,
        layers=[LayerAgreement(int(layer), float(n / rows)) for layer, n in zip(layers, same_per_layer)],
        requests=per_request, first_parting=first, routes_a=list(routes_a), routes_b=list(routes_b))
