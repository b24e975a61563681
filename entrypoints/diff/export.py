"""Per-position export of a diff (`--export parquet|csv|jsonl`): one row per scored trace position."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .results import DiffResult

EXPORT_FORMATS = ("parquet", "csv", "jsonl")
EXPORT_STEM = "positions"  # positions.parquet, positions.csv, positions.jsonl next to diff.json
PARQUET_INSTALL = "pip install 'replayllm[parquet]' (or: pip install pyarrow)"

# (column, type) in file order; the types name what a reader gets back: "str", "int", "float", "bool". Never
# null: request_id, position, token, logprob_a/b, delta, abs_delta. docs/diff.md describes every column.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("request_id", "str"), ("position", "int"), ("token", "int"), ("text", "str"),
    ("logprob_a", "float"), ("logprob_b", "float"), ("delta", "float"), ("abs_delta", "float"),
    ("rank_a", "int"), ("rank_b", "int"),
    ("top1_a", "int"), ("top1_text_a", "str"), ("top1_b", "int"), ("top1_text_b", "str"),
    ("argmax_flip", "bool"), ("kl", "float"),
)


def parse_export_formats(values: str | Iterable[str] | None) -> tuple[str, ...]:
    """`"parquet,csv"` or `["parquet", "csv,jsonl"]` (a repeated flag) -> ("parquet", "csv", "jsonl"), in the
    order given, each once. Raises ValueError for an unknown format, or for parquet without pyarrow (naming the
    install command), so a bad --export stops the diff before any side runs."""
    if values is None:
        return ()
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"export formats are strings, got {item!r}")
        for name in item.split(","):
            name = name.strip().lower()
            if name not in EXPORT_FORMATS:
                raise ValueError(f"unknown export format {name!r}; choose from {', '.join(EXPORT_FORMATS)} "
                                 "(a comma list or a repeated --export)")
            if name not in out:
                out.append(name)
    if "parquet" in out:
        _pyarrow()
    return tuple(out)


def export_rows(result: DiffResult) -> list[dict[str, Any]]:
    """One dict per scored position, in trace order, with the COLUMNS keys (argmax_flip: the two sides' top-1
    tokens differ; null when a side reported no alternatives)."""
    texts = result.token_texts
    rows = []
    for t in result.tokens:
        agree = t.argmax_agree
        rows.append({
            "request_id": t.request_id, "position": t.position, "token": t.token, "text": t.text,
            "logprob_a": t.logprob_a, "logprob_b": t.logprob_b, "delta": t.delta,
            "abs_delta": abs(t.delta), "rank_a": t.rank_a, "rank_b": t.rank_b,
            "top1_a": t.top1_a, "top1_text_a": None if t.top1_a is None else texts.get(t.top1_a),
            "top1_b": t.top1_b, "top1_text_b": None if t.top1_b is None else texts.get(t.top1_b),
            "argmax_flip": None if agree is None else not agree,
            "kl": t.kl if math.isfinite(t.kl) else None,
        })
    return rows


def write_export(result: DiffResult, out_dir: str | os.PathLike, formats: str | Iterable[str]) -> list[Path]:
    """Write positions.<format> for each format into out_dir; returns the paths."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rows = export_rows(result)
    paths = []
    for fmt in parse_export_formats(formats):
        path = directory / f"{EXPORT_STEM}.{fmt}"
        {"parquet": _write_parquet, "csv": _write_csv, "jsonl": _write_jsonl}[fmt](rows, path)
        paths.append(path)
    return paths


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    """RFC 4180 CSV with a header; null is an empty cell, booleans `true`/`false`, floats in Python's shortest
    round-trip form (reading them back gives the same float64)."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([name for name, _ in COLUMNS])
        for row in rows:
            writer.writerow([_csv_cell(row[name]) for name, _ in COLUMNS])


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    pa = _pyarrow()
    import pyarrow.parquet as pq

    types = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_()}
    schema = pa.schema([(name, types[kind]) for name, kind in COLUMNS])
    table = pa.table({name: [row[name] for row in rows] for name, _ in COLUMNS}, schema=schema)
    pq.write_table(table, path)


def _pyarrow():
    try:
        import pyarrow
    except ImportError:
        raise ValueError(f"--export parquet needs pyarrow, which is not installed: {PARQUET_INSTALL}") from None
    return pyarrow
