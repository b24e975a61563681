"""Diff reports: `diff.json` (every key documented in docs/diff.md), `summary.md` and the PNG plots."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .results import DiffResult, DiffStats, TokenDiff
from .spec import SideSpec

FORMAT = "replayllm-diff/1"  # bumped whenever a key changes meaning or disappears
JSON_NAME = "diff.json"
SUMMARY_NAME = "summary.md"
_WORST = 10  # rows in the summary's "largest |Δ|" table


@dataclass(frozen=True)
class ReportFiles:
    directory: Path
    json: Path
    summary: Path
    plots: list[Path]


def default_out_dir(parent: str | os.PathLike = ".") -> Path:
    """A new folder name `diff-YYYYmmdd-HHMMSS` under `parent` (suffixed -2, -3, ... if taken)."""
    base = Path(parent) / time.strftime("diff-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def write_report(result: DiffResult, out_dir: str | os.PathLike | None = None, *, plots: bool = True) -> ReportFiles:
    """Write diff.json, summary.md and (with plots=True) the PNGs into out_dir (default: a new
    timestamped folder in the current directory). Returns the paths written."""
    directory = Path(out_dir) if out_dir is not None else default_out_dir()
    directory.mkdir(parents=True, exist_ok=True)
    pngs: list[Path] = []
    if plots:
        from .plots import write_plots

        pngs = write_plots(result, directory)
    json_path = directory / JSON_NAME
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(to_json(result), f, indent=1, ensure_ascii=False, allow_nan=False)
        f.write("\n")
    summary_path = directory / SUMMARY_NAME
    summary_path.write_text(to_markdown(result, [p.name for p in pngs]), encoding="utf-8")
    return ReportFiles(directory, json_path, summary_path, pngs)


# -- JSON --------------------------------------------------------------------------------------------------
def to_json(result: DiffResult) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "model": result.model,
        "traces": result.traces,
        "a": _side_json(result.a),
        "b": _side_json(result.b),
        "top_k": result.top_k,
        "full_vocab": result.full_vocab,
        "threshold": result.threshold,
        "kl_method": result.kl_method,
        "num_requests": len(result.requests),
        "num_tokens": result.overall.num_tokens,
        "seconds": {"a": result.seconds_a, "b": result.seconds_b},
        "overall": _stats_json(result.overall),
        "requests": [{"id": r.request_id, **_stats_json(r.stats)} for r in result.requests],
        "tokens": [_token_json(t) for r in result.requests for t in r.tokens],
    }


def _side_json(spec: SideSpec) -> dict[str, Any]:
    return {"spec": spec.text, "kind": spec.kind, "options": dict(spec.options)}


def _stats_json(stats: DiffStats) -> dict[str, Any]:
    return {k: _finite(v) for k, v in dataclasses.asdict(stats).items()}


def _token_json(t: TokenDiff) -> dict[str, Any]:
    return {"request_id": t.request_id, "position": t.position, "token": t.token, "text": t.text,
            "logprob_a": t.logprob_a, "logprob_b": t.logprob_b, "delta": t.delta,
            "rank_a": t.rank_a, "rank_b": t.rank_b, "top1_a": t.top1_a, "top1_b": t.top1_b,
            "argmax_agree": t.argmax_agree, "kl": _finite(t.kl)}


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: those become null (they cannot come from finite logprobs, but stay safe)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


# -- Markdown ----------------------------------------------------------------------------------------------
def to_markdown(result: DiffResult, plot_files: Sequence[str] = ()) -> str:
    o = result.overall
    lines = [
        f"# replayllm diff: A `{result.a}` vs B `{result.b}`",
        "",
        f"- model: `{result.model}`",
        f"- traces: `{result.traces or '(in memory)'}` ({len(result.requests)} requests, {o.num_tokens} tokens)",
        f"- Δ = logprob B − logprob A of each trace token; divergence threshold |Δ| > {_num(result.threshold)}",
        f"- KL(A‖B) per position: {result.kl_method}"
        + ("" if result.full_vocab else " — a lower bound of the exact KL; run with `--full-vocab` for the exact one"),
        f"- time: side A {result.seconds_a:.1f} s, side B {result.seconds_b:.1f} s",
        "",
        "## Overall",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value} |" for name, value in _stats_rows(o)]
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plot_files]
    bar = "\\|Δ\\|"  # |Δ| inside a table cell
    lines += ["", "## Requests", "",
              f"| id | tokens | mean {bar} | max {bar} | p99 {bar} | argmax agreement | first divergence | mean KL |",
              "|---|---|---|---|---|---|---|---|"]
    for r in result.requests:
        s = r.stats
        lines.append(f"| {_cell(r.request_id)} | {s.num_tokens} | {_num(s.mean_abs_delta)} | {_num(s.max_abs_delta)} | "
                     f"{_num(s.p99_abs_delta)} | {_pct(s.argmax_agreement)} | "
                     f"{'—' if s.first_divergence is None else s.first_divergence} | {_num(s.mean_kl)} |")
    lines += ["", f"## Largest |Δ| (top {_WORST})", "",
              "| request | position | token | text | logprob A | logprob B | Δ | rank A | rank B |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t in result.worst(_WORST):
        lines.append(f"| {_cell(t.request_id)} | {t.position} | {t.token} | {_cell(repr(t.text)) if t.text else ''} | "
                     f"{t.logprob_a:.5f} | {t.logprob_b:.5f} | {_num(t.delta)} | {_opt(t.rank_a)} | {_opt(t.rank_b)} |")
    return "\n".join(lines) + "\n"


def _stats_rows(s: DiffStats) -> list[tuple[str, str]]:
    first = "none" if s.first_divergence is None else \
        f"position {s.first_divergence} of request `{s.first_divergence_request}`"
    return [("tokens", str(s.num_tokens)), ("max \\|Δ\\|", _num(s.max_abs_delta)),
            ("mean \\|Δ\\|", _num(s.mean_abs_delta)), ("mean Δ (signed)", _num(s.mean_delta)),
            ("p50 / p90 / p99 \\|Δ\\|", " / ".join(_num(x) for x in (s.p50_abs_delta, s.p90_abs_delta,
                                                                      s.p99_abs_delta))),
            ("argmax agreement", _pct(s.argmax_agreement)), ("mean KL", _num(s.mean_kl)), ("max KL", _num(s.max_kl)),
            ("first divergence", first), ("requests diverged", str(s.num_diverged_requests))]


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a (no top-k on one side)" if x is None else f"{100 * x:.1f}%"


def _opt(x: int | None) -> str:
    return "" if x is None else str(x)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "\\`").replace("\n", " ")
