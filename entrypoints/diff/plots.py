"""Diff plots (PNG, matplotlib's Agg renderer through Figure objects: no pyplot, no global backend change)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .results import DiffResult

ABS_DELTA_PNG = "abs_delta_by_position.png"
HISTOGRAM_PNG = "delta_histogram.png"
LAYERS_PNG = "rel_diff_by_layer.png"
_LINEAR_BELOW = 1e-7  # symlog y axis: linear below this |Δ| (float32 rounding), logarithmic above


def write_plots(result: DiffResult, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    paths = [out / ABS_DELTA_PNG, out / HISTOGRAM_PNG]
    plot_abs_delta_by_position(result, paths[0])
    plot_delta_histogram(result, paths[1])
    if result.localization is not None:
        paths.append(out / LAYERS_PNG)
        plot_rel_diff_by_layer(result, paths[2])
    return paths


def plot_rel_diff_by_layer(result: DiffResult, path: str | Path) -> None:
    """The relative difference ‖A − B‖ / ‖A‖ of the residual stream at every checkpoint, the first jump marked."""
    loc = result.localization
    fig, ax = _figure()
    values = np.array([c.rel_diff for c in loc.checkpoints])
    x = np.arange(len(values))
    ax.plot(x, values, marker="o", markersize=4, color="tab:blue", linewidth=1.2)
    if loc.first_jump is not None:
        j = loc.checkpoints.index(loc.first_jump)
        ax.axvline(j, color="tab:red", linewidth=1.5, label=f"first jump: {loc.first_jump.name}")
        ax.legend(fontsize=8, loc="best", framealpha=0.9)
    ax.set_yscale("symlog", linthresh=_LINEAR_BELOW)
    ax.set_ylim(0, max(float(values.max()), loc.min_jump) * 3)
    ax.set_xticks(x, [c.name.replace("layer ", "L").replace(" attention", " attn") for c in loc.checkpoints],
                  rotation=60, fontsize=7, ha="right")
    ax.set_ylabel("‖A − B‖ / ‖A‖")
    ax.set_title(f"{_title(result)}\nresidual stream at {len(loc.positions)} position(s)", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def _figure():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4), dpi=100, layout="constrained")
    return fig, fig.subplots()


def _title(result: DiffResult) -> str:
    return f"A: {result.a}   vs   B: {result.b}"


def plot_abs_delta_by_position(result: DiffResult, path: str | Path) -> None:
    """Every token's |Δ| against its trace position, the per-position maximum, the threshold and the noise
    threshold, the first argmax flip and the first divergence (earliest position with |Δ| > threshold) marked."""
    fig, ax = _figure()
    tokens = result.tokens
    pos = np.array([t.position for t in tokens])
    absd = np.array([abs(t.delta) for t in tokens])
    ax.scatter(pos, absd, s=8, alpha=0.35, color="tab:blue", label="each token", linewidths=0)
    width = int(pos.max()) + 1
    peak = np.zeros(width)
    np.maximum.at(peak, pos, absd)
    ax.plot(np.arange(width), peak, color="tab:blue", linewidth=1.2, label="max over requests")
    ax.axhline(result.threshold, color="tab:gray", linestyle="--", linewidth=1, label=f"threshold {result.threshold:g}")
    if result.noise_threshold > 0:
        ax.axhline(result.noise_threshold, color="tab:orange", linestyle=":", linewidth=1.2,
                   label=f"noise threshold {result.noise_threshold:.3g} ({result.noise_factor:g} × median)")
    o = result.overall
    if o.first_flip is not None:
        ax.axvline(o.first_flip, color="tab:purple", linewidth=1.5, linestyle="-.",
                   label=f"first argmax flip: position {o.first_flip} of request {o.first_flip_request!r}")
    if o.first_divergence is not None:
        ax.axvline(o.first_divergence, color="tab:red", linewidth=1.5,
                   label=f"first divergence: position {o.first_divergence} of request {o.first_divergence_request!r}")
    ax.set_yscale("symlog", linthresh=_LINEAR_BELOW)
    top = max(float(absd.max()), result.threshold, result.noise_threshold)
    ax.set_ylim(0, top * 3)  # headroom above the largest |Δ| (log scale)
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_xlabel("trace position")
    ax.set_ylabel("|Δ logprob|  (|B − A|)")
    ax.set_title(_title(result), fontsize=10)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    ax.grid(True, alpha=0.3)
    fig.savefig(path)


def plot_delta_histogram(result: DiffResult, path: str | Path) -> None:
    """Histogram of the signed Δ = B − A over every token."""
    fig, ax = _figure()
    delta = np.array([t.delta for t in result.tokens])
    ax.hist(delta, bins=60, color="tab:blue", alpha=0.8)
    ax.axvline(0.0, color="tab:gray", linewidth=1)
    ax.set_xlabel("Δ logprob (B − A)")
    ax.set_ylabel("tokens")
    ax.set_title(f"{_title(result)}\nmean Δ {delta.mean():+.3g}, std {delta.std():.3g}, n={delta.size}", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.savefig(path)
