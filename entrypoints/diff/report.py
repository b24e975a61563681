"""The diff report as JSON (`diff.json`, every key documented in docs/diff.md) and Markdown (`summary.md`)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from .results import DiffResult, DiffStats, Flip, TokenDiff
from .routing_report import routing_json, routing_line, routing_markdown
from .spec import SideSpec

FORMAT = "replayllm-diff/1"  # bumped whenever a key changes meaning or disappears
_WORST = 10  # rows in the summary's "largest |Δ|" table
_FLIPS = 50  # rows in the summary's argmax-flip table (all of them are in diff.json)


# -- JSON --------------------------------------------------------------------------------------------------
def to_json(result: DiffResult) -> dict[str, Any]:
    routing = {} if result.routing is None else {"routing": routing_json(result.routing)}  # MoE models only
    return {
        "format": FORMAT,
        "model": result.model,
        "traces": result.traces,
        "a": _side_json(result.a, result.resolved_a),
        "b": _side_json(result.b, result.resolved_b),
        "versions": result.versions,
        "provenance": result.provenance,
        "top_k": result.top_k,
        "full_vocab": result.full_vocab,
        "threshold": result.threshold,
        "noise_factor": result.noise_factor,
        "noise_threshold": result.noise_threshold,
        "kl_method": result.kl_method,
        "num_requests": len(result.requests),
        "num_tokens": result.overall.num_tokens,
        "seconds": {"a": result.seconds_a, "b": result.seconds_b},
        "overall": _stats_json(result.overall),
        "flips": [dataclasses.asdict(f) for f in result.flips],
        "localization": None if result.localization is None else _localization_json(result.localization),
        **routing,
        "requests": [{"id": r.request_id, **_stats_json(r.stats)} for r in result.requests],
        "tokens": [_token_json(t) for r in result.requests for t in r.tokens],
    }


def _localization_json(loc) -> dict[str, Any]:
    return {"positions": [{"request_id": r, "position": p} for r, p in loc.positions],
            "checkpoints": [dataclasses.asdict(c) for c in loc.checkpoints],
            "first_jump": None if loc.first_jump is None else loc.first_jump.name,
            "jump_factor": loc.jump_factor, "min_jump": loc.min_jump}


def _side_json(spec: SideSpec, resolved: dict[str, Any]) -> dict[str, Any]:
    return {"spec": spec.text, "kind": spec.kind, "options": dict(spec.options), "resolved": dict(resolved)}


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
    lines = [f"# replayllm diff: A `{result.a}` vs B `{result.b}`", "", "## At a glance", ""]
    lines += [f"- {line}" for line in headline(result, markdown=True)]
    lines += _flip_table(result)
    lines += [] if result.routing is None else routing_markdown(result.routing)
    lines += _layer_table(result)
    lines += _setup_table(result)
    lines += [
        "",
        "## Run",
        "",
        f"- model: `{result.model}`",
        f"- traces: `{result.traces or '(in memory)'}` ({len(result.requests)} requests, {o.num_tokens} tokens)",
        f"- Δ = logprob B − logprob A of each trace token; divergence threshold |Δ| > {_num(result.threshold)}; "
        f"noise threshold {_num(result.noise_threshold)} = {result.noise_factor:g} × the median |Δ| of the run",
        f"- KL(A‖B) per position: {result.kl_method}"
        + ("" if result.full_vocab else " — a lower bound of the exact KL; run with `--full-vocab` for the exact one"),
        f"- time: side A {result.seconds_a:.1f} s, side B {result.seconds_b:.1f} s",
        "",
        "## Overall",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value} |" for name, value in stats_rows(o)]
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plot_files]
    bar = "\\|Δ\\|"  # |Δ| inside a table cell
    lines += ["", "## Requests", "",
              f"| id | tokens | argmax flips | first flip | first above noise | mean {bar} | max {bar} | p99 {bar} | "
              "first divergence | mean KL |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.requests:
        s = r.stats
        flips = "unknown" if s.num_flips is None else s.num_flips
        lines.append(f"| {_cell(r.request_id)} | {s.num_tokens} | {flips} | {_dash(s.first_flip)} | "
                     f"{_dash(s.first_above_noise)} | {_num(s.mean_abs_delta)} | {_num(s.max_abs_delta)} | "
                     f"{_num(s.p99_abs_delta)} | {_dash(s.first_divergence)} | {_num(s.mean_kl)} |")
    lines += ["", f"## Largest |Δ| (top {_WORST})", "",
              "| request | position | token | text | logprob A | logprob B | Δ | rank A | rank B |",
              "|---|---|---|---|---|---|---|---|---|"]
    for t in result.worst(_WORST):
        lines.append(f"| {_cell(t.request_id)} | {t.position} | {t.token} | {_cell(repr(t.text)) if t.text else ''} | "
                     f"{t.logprob_a:.5f} | {t.logprob_b:.5f} | {_num(t.delta)} | {_opt(t.rank_a)} | {_opt(t.rank_b)} |")
    return "\n".join(lines) + "\n"


def headline(result: DiffResult, markdown: bool = False) -> list[str]:
    """The lines a reader needs first: argmax flips, the first flip, the first position above the run's noise,
    the largest |Δ|. Shared by summary.md and the console."""
    o = result.overall
    code = (lambda x: f"`{x}`") if markdown else repr
    where = lambda pos, req: "none" if pos is None else f"position {pos} of request {code(req)}"  # noqa: E731
    if o.argmax_agreement is None:
        flips = "argmax flips: unknown (a side reported no top-k alternatives)"
    elif not result.flips:
        flips = f"argmax flips: none (the top-1 token agrees at all {o.num_tokens} positions)"
    else:
        first = min(result.flips, key=lambda f: f.position)
        flips = (f"argmax flips: {len(result.flips)} of {o.num_tokens} positions "
                 f"({100 * (1 - o.argmax_agreement):.1f}%); first at {where(o.first_flip, o.first_flip_request)}: "
                 f"A picks {_tok(first.top1_a, first.top1_text_a)}, B picks {_tok(first.top1_b, first.top1_text_b)}")
    worst = result.worst(1)[0]
    layers = localization_line(result)
    return [
        flips,
        *([] if result.routing is None else [routing_line(result.routing, markdown)]),
        *([layers.replace("**", "") if not markdown else layers] if layers else []),
        f"first |Δ| above the run's noise (|Δ| > {_num(result.noise_threshold)} = {result.noise_factor:g} × median "
        f"|Δ| {_num(result.noise_threshold / result.noise_factor)}): "
        + ("none (no position stands out of the noise)" if o.first_above_noise is None
           else where(o.first_above_noise, o.first_above_noise_request)),
        f"largest |Δ| {_num(o.max_abs_delta)} "
        + ("(identical at every position)" if o.max_abs_delta == 0 else f"at {where(worst.position, worst.request_id)}")
        + f"; mean |Δ| "
        f"{_num(o.mean_abs_delta)}, p99 {_num(o.p99_abs_delta)}, mean KL {_num(o.mean_kl)} [{result.kl_method}]",
        f"first |Δ| > --threshold {_num(result.threshold)}: {where(o.first_divergence, o.first_divergence_request)} "
        f"({o.num_diverged_requests} of {len(result.requests)} requests)",
    ]


def flip_line(f: Flip) -> str:
    """One argmax flip in words (the console's list)."""
    return (f"request {f.request_id!r} position {f.position}: A top-1 {_tok(f.top1_a, f.top1_text_a)}, "
            f"B top-1 {_tok(f.top1_b, f.top1_text_b)}; trace token {_tok(f.token, f.text)} rank A "
            f"{_opt(f.rank_a) or '?'} / B {_opt(f.rank_b) or '?'}, Δ {_num(f.delta)}")


def _flip_table(result: DiffResult) -> list[str]:
    if not result.flips:
        return []
    more = f", first {_FLIPS} shown; all in diff.json" if len(result.flips) > _FLIPS else ""
    lines = ["", f"## Argmax flips ({len(result.flips)}{more})", "",
             "| request | position | A top-1 | B top-1 | trace token | rank A | rank B | Δ |",
             "|---|---|---|---|---|---|---|---|"]
    for f in result.flips[:_FLIPS]:
        lines.append(f"| {_cell(f.request_id)} | {f.position} | {_cell(_tok(f.top1_a, f.top1_text_a))} | "
                     f"{_cell(_tok(f.top1_b, f.top1_text_b))} | {_cell(_tok(f.token, f.text))} | {_opt(f.rank_a)} | "
                     f"{_opt(f.rank_b)} | {_num(f.delta)} |")
    return lines


def localization_line(result: DiffResult) -> str | None:
    """Where the setups part, by layer (None without --localize)."""
    loc = result.localization
    if loc is None:
        return None
    where = f"over {len(loc.positions)} position(s)"
    if loc.first_jump is None:
        return f"layers: no checkpoint jumps above the earlier ones' floor ({where}; largest relative difference " \
               f"{_num(max(c.rel_diff for c in loc.checkpoints))})"
    j = loc.first_jump
    before = [c.rel_diff for c in loc.checkpoints[: loc.checkpoints.index(j)]]
    since = f"up from at most {_num(max(before))} before it" if before else "already at the first checkpoint"
    return f"layers: the setups part at **{j.name}** (relative difference {_num(j.rel_diff)}, {since}; {where})"


def _layer_table(result: DiffResult) -> list[str]:
    loc = result.localization
    if loc is None:
        return []
    lines = ["", "## Where the setups part, by layer", "",
             f"The residual stream after every decoder sub-block, on both sides, at {len(loc.positions)} position(s) "
             "(argmax flips first, then the largest |Δ|): "
             + ", ".join(f"`{r}`:{p}" for r, p in loc.positions) + ". Relative difference ‖A − B‖ / ‖A‖; the first "
             f"checkpoint above max({loc.jump_factor:g} × the largest before it, {_num(loc.min_jump)}) is named.",
             "", "| checkpoint | relative difference |", "|---|---|"]
    for c in loc.checkpoints:
        name = f"**{c.name}** (first jump)" if c is loc.first_jump else c.name
        lines.append(f"| {name} | {_num(c.rel_diff)} |")
    return lines


def _setup_table(result: DiffResult) -> list[str]:
    """What each side resolved to, side by side (differing rows in bold), the versions, the capture."""
    a, b = result.resolved_a, result.resolved_b
    keys = list(dict.fromkeys([*a, *b]))
    lines = ["", "## Setups", "", "| | A | B |", "|---|---|---|",
             f"| spec | `{_cell(result.a.text)}` | `{_cell(result.b.text)}` |",
             f"| kind | {result.a.kind} | {result.b.kind} |"]
    for k in keys:
        va, vb = _cell(str(a.get(k, ""))), _cell(str(b.get(k, "")))
        name = f"**{k}**" if k in a and k in b and a[k] != b[k] else k
        lines.append(f"| {name} | {va} | {vb} |")
    versions = ", ".join(f"{k} {v}" for k, v in result.versions.items() if v is not None)
    lines += ["", f"Versions (this diff run): {versions or 'unknown'}."]
    p = result.provenance
    if p is not None:
        lines += ["", "Trace provenance (written by `replayllm capture`):", ""]
        lines += [f"- {k}: `{_cell(json.dumps(v, ensure_ascii=False))}`" for k, v in p.items()]
    return lines


def _tok(token: int | None, text: str | None) -> str:
    """`' the' (279)` with a tokenizer, `279` without."""
    if token is None:
        return "?"
    return str(token) if text is None else f"{text!r} ({token})"


def _dash(x: int | None) -> str:
    return "—" if x is None else str(x)


def stats_rows(s: DiffStats, markdown: bool = True) -> list[tuple[str, str]]:
    """(metric, value) rows of one DiffStats: summary.md's overall table (markdown=True escapes `|` for a table
    cell and quotes request ids in backticks) and the HTML report's (plain text)."""
    bar = "\\|Δ\\|" if markdown else "|Δ|"
    where = lambda pos, req: "none" if pos is None else (  # noqa: E731
        f"position {pos} of request " + (f"`{req}`" if markdown else repr(req)))
    return [("tokens", str(s.num_tokens)), (f"max {bar}", _num(s.max_abs_delta)),
            (f"mean {bar}", _num(s.mean_abs_delta)), ("mean Δ (signed)", _num(s.mean_delta)),
            (f"p50 / p90 / p99 {bar}", " / ".join(_num(x) for x in (s.p50_abs_delta, s.p90_abs_delta,
                                                                     s.p99_abs_delta))),
            ("argmax agreement", _pct(s.argmax_agreement)), ("mean KL", _num(s.mean_kl)), ("max KL", _num(s.max_kl)),
            ("argmax flips", "unknown (a side reported no top-k)" if s.num_flips is None else str(s.num_flips)),
            ("first argmax flip", "unknown" if s.num_flips is None else where(s.first_flip, s.first_flip_request)),
            ("first above noise", where(s.first_above_noise, s.first_above_noise_request)),
            (f"first divergence ({bar} > threshold)", where(s.first_divergence, s.first_divergence_request)),
            ("requests diverged", str(s.num_diverged_requests))]


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a (no top-k on one side)" if x is None else f"{100 * x:.1f}%"


def _opt(x: int | None) -> str:
    return "" if x is None else str(x)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "\\`").replace("\n", " ")
