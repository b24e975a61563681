"""KL(A‖B) per position: exact over the full vocabulary, or a top-k estimate (a lower bound of the exact one)."""

from __future__ import annotations

import math

import numpy as np

EXACT = "exact (full vocabulary)"


def topk_method(k: int) -> str:
    return f"top-k estimate (k={k})"


def exact_kl(a_rows: np.ndarray, b_rows: np.ndarray, chunk: int = 256) -> np.ndarray:
    """a_rows, b_rows [n, V] log-softmax rows -> [n] float64 KL(A‖B) = Σ_v p_A(v) (log p_A(v) − log p_B(v)).

    Rows are renormalised in float64 first (a float32 log_softmax sums to 1 only up to rounding), so the
    result is a true KL between two distributions: 0 for identical rows, and >= 0 (float64 rounding below 0
    is clamped). Computed with torch, `chunk` rows at a time (bounding the float64 copies), on the GPU when
    there is one (a [1024, 150k] request takes ~10 s on two CPU cores, milliseconds on a GPU).
    """
    import torch

    if a_rows.shape != b_rows.shape:
        raise ValueError(f"full-vocabulary rows differ in shape: {a_rows.shape} vs {b_rows.shape}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(a_rows.shape[0], dtype=torch.float64)
    with torch.no_grad():
        for s in range(0, a_rows.shape[0], chunk):
            a = torch.from_numpy(np.ascontiguousarray(a_rows[s : s + chunk])).to(device).double().log_softmax(-1)
            b = torch.from_numpy(np.ascontiguousarray(b_rows[s : s + chunk])).to(device).double().log_softmax(-1)
            out[s : s + chunk] = (a.exp() * (a - b)).sum(-1).cpu()
    return out.clamp_min_(0.0).numpy()


def topk_kl(known_a: dict[int, float], known_b: dict[int, float]) -> float:
    """KL(A‖B) estimated from what both sides report at one position.

    `known_*` = {token: logprob} the side reported (its top-k plus the trace token). The distributions are
    coarse-grained to the tokens known on BOTH sides plus one "rest" bucket holding the remaining mass; the
    KL of these coarse distributions is what is returned. By the data-processing inequality it is a lower
    bound of the exact KL (equal when the tokens outside the shared set carry no mass), it is >= 0, and it is
    exactly 0 when both sides report the same numbers.
    """
    shared = known_a.keys() & known_b.keys()
    kl = 0.0
    mass_a = mass_b = 0.0
    for t in shared:
        la, lb = known_a[t], known_b[t]
        pa = math.exp(la)
        kl += pa * (la - lb)
        mass_a += pa
        mass_b += math.exp(lb)
    rest_a, rest_b = 1.0 - mass_a, 1.0 - mass_b
    if rest_a > 1e-12:  # below that the bucket is rounding noise on A's side: it contributes nothing
        kl += rest_a * (math.log(rest_a) - math.log(max(rest_b, 1e-30)))
    return max(kl, 0.0)
