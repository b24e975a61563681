"""`replayllm diff --export parquet|csv|jsonl`: per-position rows that read back exactly, from the CLI and the API."""

from __future__ import annotations

import csv
import json
import sys

import pytest
from helpers.diff_samples import EVIL, synthetic_result

from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import EXPORT_FORMATS, TraceRecord, export_rows, write_export, write_traces
from replayllm.entrypoints.diff.export import COLUMNS, parse_export_formats

_CSV_TYPES = {"str": str, "int": int, "float": float, "bool": lambda s: {"true": True, "false": False}[s]}


def _read_csv(path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == [name for name, _ in COLUMNS]
        kinds = dict(COLUMNS)
        # An empty cell is null, except in `text`: there it reads as '' (csv cannot tell an empty token text
        # from a missing one; the sample has both).
        return [{k: (None if v == "" and k != "text" else _CSV_TYPES[kinds[k]](v)) for k, v in row.items()}
                for row in reader]


def _read(path, fmt: str) -> list[dict]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if fmt == "jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return _read_csv(path)


def test_rows_name_every_position_and_read_back_exactly_in_every_format(tmp_path):
    result = synthetic_result()
    rows = export_rows(result)
    assert [(r["request_id"], r["position"]) for r in rows] == [(t.request_id, t.position) for t in result.tokens]
    assert list(rows[0]) == [name for name, _ in COLUMNS]
    flip = rows[4]  # request r1 position 0: top-1 10 on A, 8 on B
    assert flip["argmax_flip"] is True and flip["top1_text_b"] == "&amp; \"quoted\" 'x'" and flip["rank_b"] == 2
    # approx: a difference of decimal literals in binary (scalar IEEE arithmetic, the same on every CPU)
    assert flip["delta"] == pytest.approx(-0.2) and flip["abs_delta"] == pytest.approx(0.2)
    assert rows[0]["text"] == EVIL and rows[0]["argmax_flip"] is False
    assert rows[5]["argmax_flip"] is None and rows[5]["top1_a"] is None and rows[5]["text"] is None
    paths = write_export(result, tmp_path, "parquet, csv,jsonl")
    assert [p.name for p in paths] == ["positions.parquet", "positions.csv", "positions.jsonl"]
    for path, fmt in zip(paths, EXPORT_FORMATS):
        back = _read(path, fmt)
        if fmt == "csv":  # csv has one null: the no-tokenizer text reads back as ''
            assert back[5]["text"] == "" and rows[5]["text"] is None
            back[5]["text"] = None
        assert back == rows, fmt


def test_formats_comma_lists_and_repeats_unknown_and_parquet_without_pyarrow(monkeypatch):
    assert parse_export_formats(["csv,JSONL", "csv", "parquet"]) == ("csv", "jsonl", "parquet")
    assert parse_export_formats(None) == () and parse_export_formats("jsonl") == ("jsonl",)
    with pytest.raises(ValueError, match="unknown export format 'xml'; choose from parquet, csv, jsonl"):
        parse_export_formats("csv,xml")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    with pytest.raises(ValueError, match=r"needs pyarrow.*pip install 'replayllm\[parquet\]'"):
        parse_export_formats("parquet")
    assert parse_export_formats("csv") == ("csv",)


def test_cli_export_flag_repeated_and_a_bad_format_fails_before_any_side_runs(tmp_path, capsys):
    records = [TraceRecord(id=f"r{i}", prompt_token_ids=[1, 2, 3], trace_token_ids=[5, 6, 7],
                           logprobs=[-0.5, -1.0, -2.0 - i], top_logprobs=[{5: -0.5}, {6: -1.0}, {7: -2.0 - i}])
               for i in range(2)]
    traces = tmp_path / "t.jsonl"
    write_traces(traces, records)
    out = tmp_path / "r"
    rc = main(["diff", "--traces", str(traces), "--a", "file", "--b", "file", "--out", str(out),
               "--export", "csv", "--export", "parquet,jsonl"])
    stdout = capsys.readouterr().out
    assert rc == 0 and "export: " in stdout and str(out / "report.html") in stdout
    for fmt in EXPORT_FORMATS:
        back = _read(out / f"positions.{fmt}", fmt)
        assert [(r["request_id"], r["position"], r["delta"]) for r in back] == [
            (f"r{i}", p, 0.0) for i in range(2) for p in range(3)]
    bad = tmp_path / "bad"
    assert main(["diff", "--traces", str(traces), "--a", "file", "--b", "file", "--out", str(bad),
                 "--export", "xlsx"]) == 2
    assert "unknown export format 'xlsx'" in capsys.readouterr().err and not bad.exists()
