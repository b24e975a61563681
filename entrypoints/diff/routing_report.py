"""The routing section of a diff's report (MoE models): diff.json's `routing` object, the at-a-glance line (console,
summary.md, report.html) and the per-layer table."""

from __future__ import annotations

import dataclasses
from typing import Any

from .routing import RoutePart, RoutingDiff


def routing_json(r: RoutingDiff) -> dict[str, Any]:
    """diff.json's `routing` (docs/diff.md lists every key)."""
    return {
        "compared": r.compared,
        "note": r.note,
        "fix_routes": r.fixed,
        "forced_side": r.forced_side,
        "top_k": r.top_k,
        "sparse_layers": list(r.sparse_layers),
        "num_positions": r.num_positions,
        "agreement": r.agreement,
        "position_agreement": r.position_agreement,
        "layers": [dataclasses.asdict(x) for x in r.layers],
        "requests": [{"id": x.request_id, "agreement": x.agreement, "first_parting": x.first_parting}
                     for x in r.requests],
        "first_parting": None if r.first_parting is None else _part_json(r.first_parting),
    }


def _part_json(p: RoutePart) -> dict[str, Any]:
    return {**dataclasses.asdict(p), "experts_a": list(p.experts_a), "experts_b": list(p.experts_b)}


def routing_line(r: RoutingDiff, markdown: bool = False) -> str:
    """One line: how often the sides' top-k expert sets agree and where they first part."""
    code = (lambda x: f"`{x}`") if markdown else repr
    fixed = (f" (fixed: side {r.fixed.upper()}'s routes replayed on side {r.forced_side.upper()})"
             if r.fixed else "")
    if not r.compared:
        return f"routing{fixed}: not compared ({r.note})"
    scope = f"top-{r.top_k} expert sets at {r.num_positions} positions × {len(r.sparse_layers)} sparse layers"
    if r.first_parting is None:
        return f"routing{fixed}: identical (the {scope} all agree)"
    p = r.first_parting
    scored = ("a prompt token" if p.trace_position is None
              else f"the forward that scores trace position {p.trace_position}")
    return (f"routing{fixed}: {_pct(r.agreement)} of routes agree ({scope}; {_pct(r.position_agreement)} of "
            f"positions agree on every layer); first parting in request {code(p.request_id)} at prompt+trace "
            f"position {p.position} ({scored}), layer {p.layer}: A {list(p.experts_a)}, B {list(p.experts_b)}")


def routing_rows(r: RoutingDiff) -> list[tuple[str, str]]:
    """(layer, agreement) per sparse layer, then the overall row."""
    if not r.compared:
        return []
    return [(str(x.layer), _pct(x.agreement)) for x in r.layers] + [("all", _pct(r.agreement))]


def routing_markdown(r: RoutingDiff) -> list[str]:
    """summary.md's "Router agreement" section."""
    lines = ["", "## Router agreement", "",
             "Per sparse layer, the share of routed positions (prompt + trace − 1 per request) whose top-k expert "
             "sets are equal on both sides (order-insensitive)."
             + (f" Routes fixed: side {r.fixed.upper()}'s routes were replayed on side {r.forced_side.upper()} "
                "(`--fix-routes`), so the logprob differences are the numerics alone." if r.fixed else ""), ""]
    if not r.compared:
        return lines + [f"Not compared: {r.note}."]
    lines += ["| layer | agreement |", "|---|---|"]
    return lines + [f"| {layer} | {value} |" for layer, value in routing_rows(r)]


def _pct(x: float | None) -> str:
    if x is None:
        return "n/a"
    text = f"{100 * x:.1f}%"
    return "99.9%" if text == "100.0%" and x < 1 else text  # never round a parting away
