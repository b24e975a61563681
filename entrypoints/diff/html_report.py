"""report.html: one self-contained page (inline CSS, script, data and plots) a person reads in a browser."""

from __future__ import annotations

import base64
import html
import json
import math
import os
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .html_template import CSS, JS, NUM_BINS
from .report import _dash, _num, _opt, _tok, headline, stats_rows
from .results import DiffResult
from .routing_report import routing_rows

HTML_NAME = "report.html"
_FLIPS = 200  # rows of the argmax-flip table (all of them are in diff.json)
# JSON inside <script>: these characters are written as \uXXXX escapes, so no token text can close the block
# ("</script>") or start markup; U+2028/2029 are line terminators to older JavaScript parsers.
_SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                              "\u2029": "\\u2029"})


def write_html(result: DiffResult, directory: str | os.PathLike, plot_files: Sequence[str | os.PathLike] = ()) -> Path:
    """Write report.html into directory, embedding the PNG plots given (paths) as data: URIs."""
    path = Path(directory) / HTML_NAME
    path.write_text(to_html(result, plot_files), encoding="utf-8")
    return path


def to_html(result: DiffResult, plot_files: Sequence[str | os.PathLike] = ()) -> str:
    e = html.escape
    title = f"replayllm diff: A {result.a} vs B {result.b}"
    parts = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(title)}</title>",
             f"<style>{CSS}</style></head><body><main>", f"<h1>{e(title)}</h1>",
             "<h2 id=\"glance\">At a glance</h2><ul class=\"glance\">",
             *(f"<li>{e(line)}</li>" for line in headline(result)), "</ul>"]
    parts += _flips(result) + _routing(result) + _requests(result) + _plots(plot_files) + _overall(result)
    parts += _layers(result)
    parts += _setups(result)
    parts += ["</main><div id=\"detail\" aria-live=\"polite\"></div>",
              f"<script type=\"application/json\" id=\"diff-data\">{_data_json(result)}</script>",
              f"<script>{JS}</script></body></html>\n"]
    return "\n".join(parts)


def display_text(token: int, text: str | None) -> str:
    """What a token's span shows: its text; `⟨id⟩` for an empty text, `[id]` without a tokenizer; control
    characters (but tab and newline, which the page lays out) as summary.md writes them, `\\x16`: raw, they are
    invisible and zero-width, a token no one can hover."""
    if text is None:
        return f"[{token}]"
    if not text:
        return f"\u27e8{token}\u27e9"
    return "".join(_escape_control(c) for c in text) if _has_control(text) else text


def is_plain(text: str | None) -> bool:
    """The span shows the token's own text (not `⟨id⟩`, `[id]` or escapes: those are greyed)."""
    return bool(text) and not _has_control(text)


def _has_control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" and c not in "\t\n" for c in text)


def _escape_control(c: str) -> str:
    return repr(c)[1:-1] if unicodedata.category(c) == "Cc" and c not in "\t\n" else c


def colour_bin(abs_delta: float, max_abs_delta: float) -> int:
    """0 for |Δ| = 0, else 1..NUM_BINS by sqrt(|Δ| / the run's max) (the sqrt spreads the small values)."""
    if abs_delta <= 0 or max_abs_delta <= 0:
        return 0
    return max(1, min(NUM_BINS, math.ceil(math.sqrt(abs_delta / max_abs_delta) * NUM_BINS)))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], row_classes: Sequence[str | None] = ()) -> str:
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(str(h))}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        cls = row_classes[i] if i < len(row_classes) and row_classes[i] else None
        out.append((f"<tr class=\"{cls}\">" if cls else "<tr>") + "".join(f"<td>{e(str(c))}</td>" for c in row)
                   + "</tr>")
    return "".join(out) + "</table>"


def _flips(result: DiffResult) -> list[str]:
    if not result.flips:
        return []
    shown = result.flips[:_FLIPS]
    more = f" (first {len(shown)} shown; all in diff.json)" if len(shown) < len(result.flips) else ""
    rows = [(f.request_id, f.position, _tok(f.top1_a, f.top1_text_a), _tok(f.top1_b, f.top1_text_b),
             _tok(f.token, f.text), _opt(f.rank_a), _opt(f.rank_b), _num(f.delta)) for f in shown]
    return [f"<h2 id=\"flips\">Argmax flips ({len(result.flips)}){html.escape(more)}</h2>",
            _table(("request", "position", "A top-1", "B top-1", "trace token", "rank A", "rank B", "Δ"), rows)]


def _layers(result: DiffResult) -> list[str]:
    loc = result.localization
    if loc is None:
        return []
    rows = [(c.name + (" (first jump)" if c is loc.first_jump else ""), _num(c.rel_diff)) for c in loc.checkpoints]
    where = ", ".join(f"{r!r}:{p}" for r, p in loc.positions)
    return ["<h2 id=\"layers\">Where the setups part, by layer</h2>",
            f"<p>Relative difference ‖A − B‖ / ‖A‖ of the residual stream at {html.escape(where)}.</p>",
            _table(("checkpoint", "relative difference"), rows,
                   ["differs" if c is loc.first_jump else None for c in loc.checkpoints])]


def _routing(result: DiffResult) -> list[str]:
    """The router agreement per sparse layer (MoE models; its at-a-glance line says where routes part)."""
    r = result.routing
    if r is None or not r.compared:
        return []
    fixed = (f" Routes fixed: side {r.fixed.upper()}'s routes were replayed on side {r.forced_side.upper()}."
             if r.fixed else "")
    return ["<h2 id=\"routing\">Router agreement</h2>",
            f"<p>Share of routed positions whose top-{r.top_k} expert sets are equal on both sides, per sparse "
            f"layer.{html.escape(fixed)}</p>",
            _table(("layer", "agreement"), routing_rows(r))]


def _setups(result: DiffResult) -> list[str]:
    a, b = result.resolved_a, result.resolved_b
    keys = list(dict.fromkeys([*a, *b]))
    rows = [("spec", result.a.text, result.b.text), ("kind", result.a.kind, result.b.kind)]
    rows += [(k, a.get(k, ""), b.get(k, "")) for k in keys]
    classes = [None, None] + ["differs" if k in a and k in b and a[k] != b[k] else None for k in keys]
    versions = ", ".join(f"{k} {v}" for k, v in result.versions.items() if v is not None) or "unknown"
    out = ["<h2 id=\"setups\">Setups (what each side resolved to; differing rows highlighted)</h2>",
           _table(("", "A", "B"), rows, classes), f"<p>Versions (this diff run): {html.escape(versions)}.</p>"]
    if result.provenance is None:
        return out + ["<p>Trace provenance: none recorded in the trace file.</p>"]
    rows = [(k, json.dumps(v, ensure_ascii=False)) for k, v in result.provenance.items()]
    return out + ["<h3>Trace provenance (written by <code>replayllm capture</code>)</h3>",
                  _table(("key", "value"), rows).replace("<td>", "<td class=\"mono\">")]


def _overall(result: DiffResult) -> list[str]:
    rows = [("id", "tokens", "argmax flips", "first flip", "first above noise", "mean |Δ|", "max |Δ|", "p99 |Δ|",
             "first divergence", "mean KL")]
    for r in result.requests:
        s = r.stats
        rows.append((r.request_id, s.num_tokens, "unknown" if s.num_flips is None else s.num_flips,
                     _dash(s.first_flip), _dash(s.first_above_noise),
                     _num(s.mean_abs_delta), _num(s.max_abs_delta), _num(s.p99_abs_delta),
                     _dash(s.first_divergence), _num(s.mean_kl)))
    run = (f"Δ = logprob B − logprob A of each trace token; divergence threshold |Δ| > {_num(result.threshold)}; "
           f"noise threshold {_num(result.noise_threshold)} = {result.noise_factor:g} × the median |Δ|; KL(A‖B): "
           f"{result.kl_method}; time: side A {result.seconds_a:.1f} s, side B {result.seconds_b:.1f} s; "
           f"model {result.model}; traces {result.traces or '(in memory)'}.")
    return ["<h2 id=\"overall\">Overall</h2>", f"<p>{html.escape(run)}</p>",
            _table(("metric", "value"), stats_rows(result.overall, markdown=False)),
            "<h2 id=\"per-request\">Requests</h2>", _table(rows[0], rows[1:])]


def _plots(plot_files: Sequence[str | os.PathLike]) -> list[str]:
    if not plot_files:
        return []
    out = ["<h2 id=\"plots\">Plots</h2>"]
    for path in plot_files:
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        out.append(f"<img class=\"plot\" alt=\"{html.escape(Path(path).name)}\" src=\"data:image/png;base64,{data}\">")
    return out


def legend(top: float) -> str:
    """The colour bins and their upper |Δ| bounds; a run without any difference has one bin (eight bins all "≤ 0"
    would read as a broken scale)."""
    if top <= 0:
        return "<span class=\"sw b0\"></span> 0: no difference at any position"
    bounds = [top * (k / NUM_BINS) ** 2 for k in range(NUM_BINS + 1)]
    return "".join(f"<span class=\"sw b{k}\"></span> {'0' if k == 0 else '≤ ' + _num(bounds[k])} "
                   for k in range(NUM_BINS + 1))


def _requests(result: DiffResult) -> list[str]:
    """Every request's trace as text, each token a span coloured by |Δ| (data-i: its row in the data block)."""
    top = result.overall.max_abs_delta
    out = ["<h2 id=\"tokens\">Tokens by |Δ|</h2>",
           "<p class=\"note\">Hover a token for both sides' logprob, rank and top-k; click to pin it (click again to "
           "release; the address #tN pins token N on opening). Underlined in red: an argmax flip. Colour: |Δ| "
           "relative to the run's largest.</p>",
           f"<div class=\"legend\">{legend(top)}</div>"]
    index = 0
    for n, r in enumerate(result.requests):
        spans = []
        for t in r.tokens:
            cls = f"t b{colour_bin(abs(t.delta), top)}" + (" flip" if t.argmax_agree is False else "") + (
                "" if is_plain(t.text) else " empty")
            spans.append(f"<span class=\"{cls}\" data-i=\"{index}\">{html.escape(display_text(t.token, t.text))}"
                         "</span>")
            index += 1
        s = r.stats
        out += [f"<section class=\"req\" id=\"req-{n}\" data-request=\"{html.escape(r.request_id)}\">",
                f"<h3>request {html.escape(repr(r.request_id))} — {s.num_tokens} tokens, {s.num_flips} argmax "
                f"flip(s), max |Δ| {_num(s.max_abs_delta)}</h3>",
                "<div class=\"toks\">" + "".join(spans) + "</div></section>"]
    return out


def token_rows(result: DiffResult) -> list[list[Any]]:
    """Per token: [request index, position, token, logprob_a, logprob_b, rank_a, rank_b, kl, top_a, top_b]
    (top_*: [[token, logprob], ...] most likely first), in the order of the spans' data-i."""
    rows = []
    for n, r in enumerate(result.requests):
        rows += [[n, t.position, t.token, t.logprob_a, t.logprob_b, t.rank_a, t.rank_b, _finite(t.kl),
                  _pairs(t.top_a), _pairs(t.top_b)] for t in r.tokens]
    return rows


def _pairs(top: tuple[tuple[int, float], ...]) -> list[list[Any]]:
    return [[tok, float(f"{lp:.7g}")] for tok, lp in top]


def _data_json(result: DiffResult) -> str:
    texts = dict(result.token_texts)
    for t in result.tokens:  # results built without compare() may lack token_texts
        texts.setdefault(t.token, t.text)
    data = {"requests": [r.request_id for r in result.requests], "tokens": token_rows(result),
            "texts": {str(k): v for k, v in texts.items()}}
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).translate(_SCRIPT_SAFE)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None

