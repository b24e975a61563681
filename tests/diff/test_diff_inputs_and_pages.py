"""What `replayllm diff` reads (a BOM, the schema's rules, capture's prompt ids) and what it shows (where all the
flips are, control-character tokens in report.html, the legend of a run without differences)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers.diff_samples import synthetic_result

import replayllm.entrypoints.diff as diff_pkg
from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import TokenDiff, TraceFileError, read_prompts, read_traces
from replayllm.entrypoints.diff.capture import check_prompts
from replayllm.entrypoints.diff.html_report import display_text, legend, to_html
from replayllm.entrypoints.diff.report import to_markdown
from replayllm.entrypoints.diff.results import Flip
from replayllm.entrypoints.diff.trace_schema import MAX_LOGPROB, json_schema

LINE = '{"id": "a", "prompt_token_ids": [1], "trace_token_ids": [5]}'


def _many_flips(n: int):
    flips = [Flip("r1", 0, 10, "x", 10, 8, "x", "y", 1, 2, -0.2)] * n
    return dataclasses.replace(synthetic_result(), flips=flips)


# -- finding 5: the flips beyond the summary's table are in diff.json ----------------------------------------------
def test_the_console_and_summary_point_to_diff_json_for_every_flip(tmp_path, capsys, monkeypatch):
    result = _many_flips(60)
    assert "## Argmax flips (60, first 50 shown; all in diff.json)" in to_markdown(result)
    traces = tmp_path / "t.jsonl"
    traces.write_text(LINE + "\n")
    monkeypatch.setattr(diff_pkg, "compare", lambda *a, **k: result)
    rc = main(["diff", "--traces", str(traces), "--a", "file", "--b", "file", "--out", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0 and f"  ... 55 more flips in {tmp_path / 'r' / 'diff.json'}" in out.splitlines()
    assert len(json.loads((tmp_path / "r" / "diff.json").read_text())["flips"]) == 60


# -- findings 9, 10: report.html -------------------------------------------------------------------------------
def test_control_character_tokens_are_visible_in_report_html():
    assert display_text(3, "\x16") == "\\x16" and display_text(4, "a\x7f\tb\n") == "a\\x7f\tb\n"
    base = synthetic_result()
    req = base.requests[1]
    ctrl = TokenDiff("r1", 2, token=22, text="\x16", logprob_a=-1.0, logprob_b=-1.0, rank_a=1, rank_b=1,
                     top1_a=22, top1_b=22, kl=0.0)
    result = dataclasses.replace(base, requests=[base.requests[0],
                                                 dataclasses.replace(req, tokens=[*req.tokens, ctrl])])
    page = to_html(result)
    assert "\x16" not in page.split("<script")[0]  # the data block keeps the text (JSON-escaped in the panel)
    assert '<span class="t b0 empty" data-i="6">\\x16</span>' in page


def test_a_run_without_differences_has_a_one_bin_legend():
    assert legend(0.0) == '<span class="sw b0"></span> 0: no difference at any position'
    assert legend(1.0).count('class="sw') == 9 and "≤ 1" in legend(1.0)


# -- finding 11: the schema, the reader and docs/diff.md agree --------------------------------------------------
@pytest.mark.parametrize("obj, valid", [({"id": ""}, False), ({"logprobs": [5e-5]}, True),
                                        ({"logprobs": [2e-4]}, False)])
def test_schema_and_reader_agree_on_ids_and_logprobs(tmp_path, obj, valid):
    import jsonschema

    line = {**json.loads(LINE), **obj}
    assert jsonschema.Draft202012Validator(json_schema()).is_valid(line) is valid
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(line) + "\n")
    if valid:
        read_traces(path)
    else:
        with pytest.raises(TraceFileError):
            read_traces(path)


def test_docs_state_the_readers_logprob_tolerance():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "diff.md").read_text()
    assert f"<= {MAX_LOGPROB:g}" in doc and "<= 0)" not in doc


# -- findings 12, 13: a BOM, capture's duplicate ids --------------------------------------------------------------
def test_a_utf8_bom_is_read(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + LINE.encode() + b"\n")
    assert read_traces(path)[0].id == "a"
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"\xef\xbb\xbfOnce\n")
    assert read_prompts(prompts)[0]["prompt"] == "Once"


def test_duplicate_prompt_ids_are_named_with_their_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x", "id": "a"}\n\n"y"\n{"prompt": "z", "id": "a"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 4: duplicate prompt id 'a' \(first on line 1\)$"):
        read_prompts(path)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: duplicate prompt id '0' \(first on prompts\[0\]\)$"):
        check_prompts(["x", {"prompt": "y", "id": 0}])
