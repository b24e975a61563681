"""`replayllm diff` reports a person reads: argmax flips first, a noise-derived first divergence, what each side
resolved to, the trace file's provenance, and transformers' attention implementation on the `hf` side."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.tolerances import LOGPROB_TOL

from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import (
    DiffResult,
    DiffStats,
    RequestDiff,
    SpecError,
    TokenDiff,
    TraceFileError,
    capture_run,
    compare,
    parse_spec,
    read_trace_file,
    read_traces,
    write_report,
    write_traces,
)
from replayllm.entrypoints.diff.report import headline, to_markdown
from replayllm.entrypoints.diff.results import Flip, noise_threshold

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128)


def _token(rid: str, pos: int, delta: float, top1_a: int | None = 7, top1_b: int | None = 7) -> TokenDiff:
    return TokenDiff(rid, pos, token=7, text=None, logprob_a=-1.0, logprob_b=-1.0 + delta, rank_a=1, rank_b=1,
                     top1_a=top1_a, top1_b=top1_b, kl=0.0)


def _result(requests: dict[str, list[TokenDiff]], factor: float = 10.0, flips: list[Flip] = ()) -> DiffResult:
    tokens = [t for ts in requests.values() for t in ts]
    noise = noise_threshold(tokens, factor)
    reqs = [RequestDiff(rid, ts, DiffStats.of(ts, 1e-3, noise)) for rid, ts in requests.items()]
    return DiffResult(model="m", a=parse_spec("dtype=float32"), b=parse_spec("dtype=bfloat16"), traces=None,
                      top_k=5, full_vocab=False, threshold=1e-3, kl_method="top-k estimate (k=5)", requests=reqs,
                      overall=DiffStats.of(tokens, 1e-3, noise), seconds_a=0.0, seconds_b=0.0,
                      noise_factor=factor, noise_threshold=noise, flips=list(flips),
                      resolved_a={"dtype": "float32", "device": "cpu"},
                      resolved_b={"dtype": "bfloat16", "device": "cpu"})


def test_first_flip_and_first_position_above_the_runs_noise():
    # Request r0: bf16-like noise ~0.01 everywhere, one jump to 0.5 at position 5; r1: a flip at position 3.
    r0 = [_token("r0", i, 0.5 if i == 5 else 0.01 * (1 + i % 3)) for i in range(8)]
    r1 = [_token("r1", i, 0.02, top1_b=9 if i == 3 else 7) for i in range(8)]
    result = _result({"r0": r0, "r1": r1})
    o = result.overall
    # 10 × the median |Δ| (approx: decimal literals in binary; scalar IEEE arithmetic, the same on every CPU)
    assert result.noise_threshold == pytest.approx(10 * 0.02)
    assert (o.first_above_noise, o.first_above_noise_request) == (5, "r0")
    assert (o.first_flip, o.first_flip_request, o.num_flips) == (3, "r1", 1)
    assert o.first_divergence == 0  # the fixed 1e-3 threshold says nothing in such a run
    assert result.requests[1].stats.first_above_noise is None and result.requests[0].stats.first_flip is None
    # A run that is bit-identical at most positions: the noise level is 0, any nonzero |Δ| stands out.
    quiet = _result({"q": [_token("q", i, 0.0 if i != 6 else 1e-6) for i in range(8)]})
    assert quiet.noise_threshold == 0.0 and quiet.overall.first_above_noise == 6


def test_an_exact_tie_is_no_argmax_flip():
    """A uniform distribution (every logprob -log V): the two sides break the tie differently, which is no flip;
    a top-1 strictly above the other side's pick is."""
    lp = -11.9312
    tie = TokenDiff("r", 0, token=0, text=None, logprob_a=lp, logprob_b=lp, rank_a=1, rank_b=1, top1_a=0, top1_b=18,
                    kl=0.0, top_a=((0, lp), (1, lp)), top_b=((18, lp), (19, lp)))
    assert tie.argmax_agree is True
    flip = TokenDiff("r", 0, token=0, text=None, logprob_a=lp, logprob_b=lp - 1e-6, rank_a=1, rank_b=2, top1_a=0,
                     top1_b=18, kl=0.0, top_a=((0, lp), (1, lp)), top_b=((18, lp), (19, lp)))
    assert flip.argmax_agree is False


def test_flips_are_unknown_not_zero_without_top_k():
    """A side without top-k alternatives (a `file` side without top_logprobs, --top-k 0): no flip can be seen, so
    diff.json says null and summary.md "unknown", never a 0 a CI gate would read as agreement."""
    result = _result({"r": [_token("r", i, 0.01, top1_a=None) for i in range(4)]})
    assert result.overall.num_flips is None and result.overall.argmax_agreement is None
    text = to_markdown(result)
    assert "| argmax flips | unknown" in text and "| first argmax flip | unknown |" in text
    assert "| r | 4 | unknown |" in text


def test_summary_leads_with_argmax_flips_in_text_or_ids():
    flip_text = Flip("r1", 3, 11, " the", top1_a=11, top1_b=12, top1_text_a=" the", top1_text_b=" a", rank_a=1,
                     rank_b=2, delta=-0.25)
    flip_ids = Flip("r1", 4, 11, None, top1_a=11, top1_b=13, top1_text_a=None, top1_text_b=None, rank_a=1,
                    rank_b=3, delta=-0.5)
    result = _result({"r1": [_token("r1", i, 0.01, top1_b=12 if i == 3 else 13 if i == 4 else 7)
                             for i in range(6)]}, flips=[flip_text, flip_ids])
    md = to_markdown(result)
    glance = md.index("## At a glance")
    assert glance < md.index("## Argmax flips (2)") < md.index("## Setups") < md.index("## Overall")
    first_bullet = md[glance:].split("\n")[2]
    assert first_bullet.startswith("- argmax flips: 2 of 6 positions") and "position 3 of request `r1`" in first_bullet
    assert "A picks ' the' (11), B picks ' a' (12)" in first_bullet
    assert "| r1 | 3 | ' the' (11) | ' a' (12) | ' the' (11) | 1 | 2 | -0.25 |" in md
    assert "| r1 | 4 | 11 | 13 | 11 | 1 | 3 | -0.5 |" in md  # no tokenizer: ids
    assert "| **dtype** | float32 | bfloat16 |" in md and "| device | cpu | cpu |" in md  # differing rows bold
    assert headline(result)[0].startswith("argmax flips: 2 of 6")


def test_default_side_records_what_it_resolved_to_and_flips_reach_the_console(tmp_path, capsys):
    records = capture_run(["Once upon a time", "The capital of France is"], max_tokens=24, top_k=5, **ENGINE)
    traces = tmp_path / "t.jsonl"
    write_traces(traces, records.records, provenance=records.provenance)
    rc = main(["diff", "--traces", str(traces), "--a", "default", "--b", "dtype=bfloat16,device=cpu",
               "--out", str(tmp_path / "r")])
    stdout = capsys.readouterr().out
    assert rc == 0
    report = json.loads((tmp_path / "r" / "diff.json").read_text())
    a, b = report["a"], report["b"]
    assert a["options"] == {} and a["resolved"]["device"] == "cpu" and a["resolved"]["attention_backend"] == "torch"
    assert a["resolved"]["dtype"] == "float32" and b["resolved"]["dtype"] == "bfloat16"  # default: the checkpoint's
    assert {a["resolved"]["cuda_graphs"], a["resolved"]["async_scheduling"], a["resolved"]["quantization"]} == {
        False, None}
    assert report["versions"]["torch"] and report["versions"]["replayllm"]
    lines = stdout.splitlines()
    assert lines[1].startswith("argmax flips:") and lines[2].startswith("first |Δ| above the run's noise")
    assert any(line.startswith("A resolved: dtype=float32 kv_cache_dtype=float32 attention_backend=torch")
               for line in lines)
    assert len(report["flips"]) == report["overall"]["num_flips"]
    for flip in report["flips"]:
        assert flip["top1_a"] != flip["top1_b"] and flip["top1_text_a"] is not None
        assert f"request {flip['request_id']!r} position {flip['position']}" in stdout


def test_capture_writes_provenance_and_diff_shows_it(tmp_path, capsys):
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    traces = tmp_path / "t.jsonl"
    rc = main(["capture", "--prompts", str(tmp_path / "p.txt"), "--out", str(traces), "--max-tokens", "4",
               "--temperature", "0.7", "--seed", "5", "--device", "cpu", "--dtype", "float32",
               "--max-model-len", "128"])
    assert rc == 0
    header = json.loads(traces.read_text().splitlines()[0])
    prov = header["provenance"]
    assert set(header) == {"provenance"}
    assert prov["model"] == "replayllm/tiny-qwen3" and prov["engine"]["dtype"] == "float32"
    assert prov["capture"] == {"max_tokens": 4, "temperature": 0.7, "seed": 5, "top_k": 5}
    assert prov["versions"]["torch"] and prov["engine"]["attention_backend"] == "torch"
    assert read_trace_file(traces).provenance == prov and len(read_traces(traces)) == 1

    capsys.readouterr()
    assert main(["diff", "--traces", str(traces), "--a", "file", "--b", "dtype=float32,device=cpu,max_model_len=128",
                 "--out", str(tmp_path / "r")]) == 0
    assert json.loads((tmp_path / "r" / "diff.json").read_text())["provenance"] == prov
    md = (tmp_path / "r" / "summary.md").read_text()
    assert "Trace provenance" in md and '"temperature": 0.7' in md


def test_old_trace_files_without_provenance_still_read_and_a_misplaced_header_is_an_error(tmp_path):
    line = '{"id": "x", "prompt_token_ids": [1, 2], "trace_token_ids": [3]}'
    old = tmp_path / "old.jsonl"
    old.write_text(line + "\n")
    assert read_trace_file(old).provenance is None and read_traces(old)[0].id == "x"
    late = tmp_path / "late.jsonl"
    late.write_text(line + '\n{"provenance": {}}\n')
    with pytest.raises(TraceFileError, match="line 2: a 'provenance' header must be the file's first line"):
        read_traces(late)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"provenance": {}, "id": "y"}\n' + line + "\n")
    with pytest.raises(TraceFileError, match="line 1: a header line holds only 'provenance'"):
        read_traces(mixed)


def test_hf_attn_implementation(tmp_path):
    assert parse_spec("hf:attn_implementation=eager").options == {"attn_implementation": "eager"}
    with pytest.raises(SpecError, match="attn_implementation='flash' is not one of eager, sdpa"):
        parse_spec("hf:attn_implementation=flash")
    assert parse_spec("hf:experts_implementation=eager").options == {"experts_implementation": "eager"}
    with pytest.raises(SpecError, match="experts_implementation='fast' is not one of eager, grouped_mm"):
        parse_spec("hf:experts_implementation=fast")
    records = capture_run(["Once upon a time"], max_tokens=6, top_k=5, **ENGINE).records
    for attn in ("eager", "sdpa"):
        result = compare(records, "dtype=float32,device=cpu,max_model_len=128",
                         f"hf:dtype=float32,device=cpu,attn_implementation={attn}")
        assert result.resolved_b["attn_implementation"] == attn
        assert result.max_abs_delta <= LOGPROB_TOL  # the engine vs transformers: fp32 rounding
    files = write_report(result, tmp_path / "r", plots=False)
    assert json.loads(Path(files.json).read_text())["b"]["resolved"]["attn_implementation"] == "sdpa"


def test_a_soft_capped_model_gets_transformers_eager_attention(monkeypatch):
    """Gemma 2's capped scores exist only in transformers' eager attention (transformers 5.17 on the GPU machine
    defaulted it to an attention without the cap; 5.25 picks eager): the hf side asks for it unless told otherwise;
    other models keep transformers' default."""
    import transformers

    from replayllm.entrypoints.diff.sides import load_hf_model

    seen = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: seen.append(kw.get("attn_implementation")) or torch.nn.Linear(1, 1))
    for cap, asked, want in ((50.0, None, "eager"), (None, None, None), (50.0, "sdpa", "sdpa")):
        mc = SimpleNamespace(path="x", dtype=torch.float32, hf_config=SimpleNamespace(attn_logit_softcapping=cap))
        load_hf_model(mc, "cpu", asked)
        assert seen[-1] == want
    kwargs = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, **kw: kwargs.append(kw) or torch.nn.Linear(1, 1))
    load_hf_model(mc, "cpu", experts_implementation="eager")  # hf:experts_implementation=eager
    assert kwargs[-1]["experts_implementation"] == "eager"
