"""Routing replay (docs/moe.md): `SamplingParams.trace_routed_experts`, the experts a request forces at its first
P positions, checked once at admission.

Layout is `CompletionOutput.routed_experts`'s: int [P, num_layers, top_k], row p = the experts every layer routes
token p to (top-k order; the order sets the order the weighted expert outputs are summed in). A dense layer's
rows are -1 and ignored; a sparse layer's rows hold k distinct ids in [0, num_experts). Checked in two parts:
the shape and values alone in SamplingParams (any engine), against the model in verify_for_engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .config import ModelConfig

_NAME = "trace_routed_experts"
_INT16_MAX = np.iinfo(np.int16).max


@dataclass(frozen=True)
class RouteShape:
    """What a model's routes look like (ModelConfig's MoE facts)."""

    num_layers: int
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of(cls, model_config: ModelConfig) -> RouteShape | None:
        """A model's routes; None for a dense model (no routes to force)."""
        mc = model_config
        return cls(mc.num_layers, mc.num_experts, mc.num_experts_per_tok, mc.moe_layers) if mc.is_moe else None


def coerce_routes(value: Any) -> np.ndarray:
    """Any int array-like [P, L, k] (numpy, nested lists, a torch tensor) -> a C-contiguous int16 copy.
    ValueError (naming the field, never echoing the input) for another shape, non-integers, ids < -1 or
    beyond int16, or one id twice in a row."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as e:  # ragged nested lists
        raise ValueError(f"{_NAME} must be a rectangular integer array [positions, num_layers, top_k]: "
                         f"{type(e).__name__}") from None
    if arr.ndim != 3 or 0 in arr.shape:
        raise ValueError(f"{_NAME} must be a non-empty integer array [positions, num_layers, top_k], got shape "
                         f"{arr.shape}")
    if arr.dtype.kind not in "iu":  # bools, floats, objects (mixed lists) are caller bugs, not expert ids
        raise ValueError(f"{_NAME} must hold integer expert ids, got dtype {arr.dtype}")
    if isinstance(value, (list, tuple)) and any(isinstance(x, bool) for x in np.asarray(value, dtype=object).flat):
        # numpy reads True among ints as 1 (a bool array is refused above; HTTP refuses JSON true)
        raise ValueError(f"{_NAME} must hold integer expert ids, got a bool")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < -1 or hi > _INT16_MAX:
        raise ValueError(f"{_NAME} ids must be expert ids from 0 to {_INT16_MAX} (or -1 on a dense layer), got "
                         f"values in [{lo}, {hi}]")
    routes = np.array(arr, dtype=np.int16, order="C")  # a copy: the caller's array may change later
    ordered = np.sort(routes, axis=-1)
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)  # [P, L, k - 1]
    if twice.any():
        p, layer, _ = np.argwhere(twice)[0]
        raise ValueError(f"{_NAME}[{p}][{layer}] names one expert twice: a row holds k distinct experts")
    return routes


def check_routes(routes: np.ndarray, shape: RouteShape | None, max_positions: int) -> None:
    """routes (coerce_routes' output) against the model and the request: ValueError if they cannot be replayed.
    max_positions: the positions the request's forwards can run (prompt + max_tokens - 1)."""
    if shape is None:
        raise ValueError(f"{_NAME} needs a mixture-of-experts model; this one is dense")
    num_positions, num_layers, k = routes.shape
    if (num_layers, k) != (shape.num_layers, shape.top_k):
        raise ValueError(f"{_NAME} must be [positions, {shape.num_layers}, {shape.top_k}] (num_layers, "
                         f"num_experts_per_tok), got [{num_positions}, {num_layers}, {k}]")
    if num_positions > max_positions:
        raise ValueError(f"{_NAME} has {num_positions} positions, more than this request can run ({max_positions}"
                         f": prompt + max_tokens - 1)")
    sparse = np.zeros(num_layers, dtype=bool)
    sparse[list(shape.moe_layers)] = True
    dense_rows = routes[:, ~sparse]
    if (dense_rows != -1).any():
        layer = int(np.flatnonzero(~sparse)[np.argwhere(dense_rows != -1)[0][1]])
        raise ValueError(f"{_NAME}: layer {layer} is dense, its rows must be -1")
    moe_rows = routes[:, sparse]
    if (moe_rows < 0).any():
        p, j, _ = np.argwhere(moe_rows < 0)[0]
        raise ValueError(f"{_NAME}[{p}][{shape.moe_layers[j]}] has a negative id on a sparse layer: every "
                         "position up to P is forced on every sparse layer")
    if moe_rows.size and int(moe_rows.max()) >= shape.num_experts:
        raise ValueError(f"{_NAME} names expert {int(moe_rows.max())}, past num_experts={shape.num_experts}")
