"""`replayllm diff` / `capture` on the embedded model: exact zeros, engine vs transformers, fp32 vs bf16, KL,
reports (JSON keys, PNGs), trace-file and SPEC validation, the full-logprobs engine extension."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers.tolerances import LOGPROB_TOL, rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import (
    SpecError,
    TraceFileError,
    TraceRecord,
    capture,
    compare,
    parse_spec,
    read_traces,
    write_traces,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Once upon a time", "The capital of France is", {"id": "ids", "prompt_token_ids": [785, 6722, 315, 9625]}]

# The documented JSON keys (docs/diff.md lists each one; test_docs_list_every_json_key checks that).
TOP_KEYS = {"format", "model", "traces", "a", "b", "versions", "provenance", "top_k", "full_vocab", "threshold",
            "noise_factor", "noise_threshold", "kl_method", "num_requests", "num_tokens", "seconds", "overall",
            "flips", "localization", "requests", "tokens"}
SIDE_KEYS = {"spec", "kind", "options", "resolved"}
STATS_KEYS = {"num_tokens", "mean_delta", "mean_abs_delta", "max_abs_delta", "p50_abs_delta", "p90_abs_delta",
              "p99_abs_delta", "argmax_agreement", "mean_kl", "max_kl", "first_divergence",
              "first_divergence_request", "num_diverged_requests", "num_flips", "first_flip", "first_flip_request",
              "first_above_noise", "first_above_noise_request"}
FLIP_KEYS = {"request_id", "position", "token", "text", "top1_a", "top1_b", "top1_text_a", "top1_text_b", "rank_a",
             "rank_b", "delta"}
LOCALIZATION_KEYS = {"positions", "checkpoints", "first_jump", "jump_factor", "min_jump", "name", "layer", "part",
                     "rel_diff"}
TOKEN_KEYS = {"request_id", "position", "token", "text", "logprob_a", "logprob_b", "delta", "rank_a", "rank_b",
              "top1_a", "top1_b", "argmax_agree", "kl"}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    """Greedy fp32 completions of three prompts (two text, one token ids) with the engine's logprobs."""
    records = capture(PROMPTS, max_tokens=6, top_k=5, device="cpu", dtype="float32", max_model_len=128)
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    write_traces(path, records)
    return path


def _run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _load(report_dir: Path) -> dict:
    return json.loads((report_dir / "diff.json").read_text())


# -- acceptance 1-3 ----------------------------------------------------------------------------------------
def test_same_config_is_exactly_zero_with_exact_kl_and_a_full_report(traces, tmp_path, capsys):
    out = tmp_path / "report"
    rc, stdout, _ = _run_cli(["diff", "--traces", str(traces), "--a", "dtype=float32,device=cpu",
                              "--b", "dtype=float32,device=cpu", "--full-vocab", "--fail-above", "0",
                              "--out", str(out), "--batch-size", "2"], capsys)
    assert rc == 0, stdout
    report = _load(out)
    assert report["kl_method"] == "exact (full vocabulary)"
    assert report["num_requests"] == 3 and report["num_tokens"] == 18
    assert all(t["delta"] == 0.0 and t["kl"] == 0.0 for t in report["tokens"])
    assert all(t["rank_a"] == t["rank_b"] and t["argmax_agree"] for t in report["tokens"])
    assert report["overall"]["max_abs_delta"] == 0.0 and report["overall"]["first_divergence"] is None
    assert report["overall"]["argmax_agreement"] == 1.0
    assert report["flips"] == [] and report["overall"]["first_flip"] is None
    assert report["overall"]["first_above_noise"] is None and report["noise_threshold"] == 0.0
    assert report["a"]["resolved"] == report["b"]["resolved"]
    assert report["a"]["resolved"]["dtype"] == "float32" and report["a"]["resolved"]["attention_backend"] == "torch"
    assert "argmax flips: none" in stdout and "argmax flips: none" in (out / "summary.md").read_text()

    # Acceptance 3: the documented keys, and valid images.
    assert set(report) == TOP_KEYS
    assert set(report["a"]) == SIDE_KEYS and report["a"]["options"] == {"dtype": "float32", "device": "cpu"}
    assert set(report["overall"]) == STATS_KEYS
    assert all(set(r) == STATS_KEYS | {"id"} for r in report["requests"])
    assert all(set(t) == TOKEN_KEYS for t in report["tokens"])
    from matplotlib.image import imread
    from PIL import Image

    for name in ("abs_delta_by_position.png", "delta_histogram.png"):
        with Image.open(out / name) as img:
            img.verify()
            assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100
        assert imread(out / name).ndim == 3
        assert f"]({name})" in (out / "summary.md").read_text()


def test_engine_fp32_vs_transformers_fp32_within_rounding(traces):
    result = compare(traces, "dtype=float32,device=cpu", "hf:dtype=float32,device=cpu", full_vocab=True)
    assert result.kl_method == "exact (full vocabulary)"
    assert 0 < result.max_abs_delta <= LOGPROB_TOL  # two implementations: another summation order
    # Every logprob of a row moved by <= d = LOGPROB_TOL: KL ~ Var_p(Δ)/2 <= d^2/2 (Δ spans at most 2d) < d^2.
    assert all(0 <= t.kl < LOGPROB_TOL**2 for t in result.tokens)
    assert result.overall.argmax_agreement == 1.0
    assert [t.token for t in result.tokens[:6]] == read_traces(traces)[0].trace_token_ids


def test_one_token_replay_is_the_default_and_the_chunk_flag_sets_both_sides(traces):
    """Engine sides replay one token a step by default (the engine's trace_replay_chunk_size): the same
    computation on both, exactly zero. A SPEC sets one side's, `trace_replay_chunk_size=`
    (--trace-replay-chunk-size) every side whose SPEC does not: chunked vs one-token within fp32 rounding."""
    cpu = "dtype=float32,device=cpu"
    one = compare(traces, cpu, cpu, top_k=3)
    assert one.resolved_a["trace_replay_chunk_size"] == 1 == one.resolved_b["trace_replay_chunk_size"]
    assert one.resolved_a["trace_replay"] == "one-token" == one.resolved_b["trace_replay"]  # reports say the mode
    assert one.max_abs_delta == 0.0
    mixed = compare(traces, cpu, cpu + ",trace_replay_chunk_size=1", top_k=3, trace_replay_chunk_size=64)
    assert mixed.resolved_a["trace_replay_chunk_size"] == 64 and mixed.resolved_b["trace_replay_chunk_size"] == 1
    assert mixed.resolved_a["trace_replay"] == "fast:64"
    assert mixed.max_abs_delta <= LOGPROB_TOL and mixed.overall.argmax_agreement == 1.0


def test_fp32_vs_bf16_is_reported_and_fail_above_exits_nonzero(traces, tmp_path, capsys):
    out = tmp_path / "bf16"
    rc, stdout, stderr = _run_cli(["diff", "--traces", str(traces), "--a", "dtype=float32", "--b",
                                   "dtype=bfloat16", "--fail-above", "1e-9", "--out", str(out)], capsys)
    assert rc == 1
    assert "FAIL: max |delta|" in stderr and "--fail-above 1e-09" in stderr
    report = _load(out)
    assert report["overall"]["max_abs_delta"] > 1e-3  # bf16 moves logprobs by ~1e-2 on this model
    assert sum(t["delta"] != 0.0 for t in report["tokens"]) > 9
    assert report["kl_method"] == "top-k estimate (k=20)"  # labelled as an estimate
    assert all(t["kl"] >= 0 for t in report["tokens"]) and report["overall"]["mean_kl"] > 0
    assert report["overall"]["first_divergence"] is not None
    assert "top-k estimate (k=20)" in (out / "summary.md").read_text()


def test_topk_kl_estimate_is_a_nonnegative_lower_bound_of_the_exact_kl():
    from replayllm.entrypoints.diff.kl import exact_kl, topk_kl

    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 300)) * 3
    b = a + rng.normal(size=a.shape) * 0.3
    la = a - np.log(np.exp(a).sum(-1, keepdims=True))
    lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
    exact = exact_kl(la.astype(np.float32), lb.astype(np.float32))
    assert np.all(exact > 0) and np.all(exact_kl(la, la) == 0)
    for i in range(50):
        token = int(rng.integers(300))
        top_a, top_b = np.argsort(-la[i])[:10], np.argsort(-lb[i])[:10]
        known_a = {int(t): float(la[i, t]) for t in [*top_a, token]}
        known_b = {int(t): float(lb[i, t]) for t in [*top_b, token]}
        est = topk_kl(known_a, known_b)
        # exact_kl reads la/lb rounded to fp32 (each moved by <= eps/2 of its magnitude): so is the KL, at most.
        assert 0 <= est <= exact[i] + rounding_tol(np.concatenate([la[i], lb[i]]))
        assert topk_kl(known_a, dict(known_a)) == 0.0


# -- capture, the `file` side, default --out, a subprocess ---------------------------------------------------
def test_capture_then_diff_against_the_stored_logprobs(tmp_path, capsys, monkeypatch):
    (tmp_path / "prompts.jsonl").write_text('"Once upon a time"\n\n{"id": "fr", "prompt": "Paris is"}\n')
    exe = Path(sys.executable).parent / "replayllm"
    cmd = [str(exe), "capture", "--prompts", "prompts.jsonl", "--out", "t.jsonl", "--max-tokens", "5",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "128"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    records = read_traces(tmp_path / "t.jsonl")
    assert [r.id for r in records] == ["0", "fr"]
    assert all(len(r.trace_token_ids) == 5 and len(r.logprobs) == 5 and len(r.top_logprobs) == 5 for r in records)
    assert records[0].prompt == "Once upon a time" and records[0].prompt_token_ids == [12522, 5193, 264, 882]

    # Replaying the capture under its own config reproduces the stored logprobs bit for bit (same batch, same
    # math: one token a step, as they were sampled).
    monkeypatch.chdir(tmp_path)
    rc, stdout, _ = _run_cli(["diff", "--traces", "t.jsonl", "--a", "file", "--b",
                              "dtype=float32,device=cpu,max_model_len=128", "--fail-above", "0"], capsys)
    assert rc == 0, stdout
    (report_dir,) = tmp_path.glob("diff-*")  # default --out: a new timestamped folder in the cwd
    assert re.fullmatch(r"diff-\d{8}-\d{6}", report_dir.name)
    report = _load(report_dir)
    assert report["a"]["kind"] == "file" and report["overall"]["max_abs_delta"] == 0.0
    assert report["kl_method"] == "top-k estimate (k=5)"  # capture stored 5 alternatives per token
    assert all(t["rank_a"] is None and t["rank_b"] >= 1 for t in report["tokens"])  # a file has no ranks


# -- validation ----------------------------------------------------------------------------------------------
GOOD = '{"id": "x", "prompt": "hi", "trace_token_ids": [1, 2]}'


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"id": "y", "prompt": "hi"}', "missing 'trace_token_ids'"),
    ('{"id": "y", "trace_token_ids": [1]}', "needs 'prompt' (text) or 'prompt_token_ids'"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": []}', "'trace_token_ids' must be a non-empty list"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": [1, -3]}', "trace_token_ids[1] must be a non-negative"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": [1], "logprobs": [-1, -2]}', "one number per trace token"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": [1], "logprobs": [0.5]}', "logprobs are log-probabilities"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": [1], "extra": 1}', "unknown key(s) 'extra'"),
    ('{"id": "y", "prompt": "hi", "trace_token_ids": [1], "top_logprobs": [{"a": -1}]}', "is not a token id"),
    ('{"id": "x", "prompt": "hi", "trace_token_ids": [1]}', "duplicate id 'x' (first on line 1)"),
])
def test_bad_trace_lines_name_the_line(tmp_path, capsys, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n")
    with pytest.raises(TraceFileError) as e:
        read_traces(path)
    assert f"{path} line 3: " in str(e.value) and message in str(e.value)
    rc, _, stderr = _run_cli(["diff", "--traces", str(path), "--a", "default", "--b", "hf"], capsys)
    assert rc == 2 and "line 3" in stderr and message in stderr


def test_trace_records_round_trip(tmp_path):
    rec = TraceRecord("r1", [5, 6], prompt="hi", prompt_token_ids=[1, 2], logprobs=[-0.5, -1.25],
                      top_logprobs=[{5: -0.5}, {7: -0.5, 6: -1.25}], meta={"k": [1]})
    write_traces(tmp_path / "t.jsonl", [rec])
    (back,) = read_traces(tmp_path / "t.jsonl")
    assert back == TraceRecord(**{**rec.__dict__, "line": 1})


def test_spec_parsing_coerces_engine_option_types():
    s = parse_spec("dtype=bfloat16,max-model-len=512,enable_prefix_caching=false,quantization=none,"
                   "gpu_memory_utilization=0.5,model=/some/ckpt")
    assert s.kind == "engine" and s.options == {"dtype": "bfloat16", "max_model_len": 512,
                                                "enable_prefix_caching": False, "quantization": None,
                                                "gpu_memory_utilization": 0.5, "model": "/some/ckpt"}
    # Every engine option passes through untouched; EngineConfig judges the value (fp8 once it lands).
    assert parse_spec("quantization=fp8,tensor_parallel_size=2").options == {"quantization": "fp8",
                                                                             "tensor_parallel_size": 2}
    assert parse_spec("hf").kind == "hf" and parse_spec("hf:dtype=bfloat16").options == {"dtype": "bfloat16"}
    assert parse_spec("file").kind == "file" and parse_spec("default").options == {}


@pytest.mark.parametrize("spec, message", [
    ("", "empty SPEC"),
    ("bfloat16", "is not understood"),
    ("dtype=float32,colour=red", "unknown engine option 'colour'"),
    ("max_model_len=big", "max_model_len='big': expected an integer"),
    ("enable_prefix_caching=maybe", "expected true or false"),
    ("dtype=float32,dtype=bfloat16", "option 'dtype' is given twice"),
    ("dtype=float32,", "is not of the form key=value"),
    ("enable_trace_replay=false", "enable_trace_replay cannot be False"),
    ("hf:dtype=bfloat16,attn=sdpa", "unknown option(s) attn for 'hf'"),
    ("file:x=1", "'file' takes no options"),
])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert message in str(e.value)


def test_specs_and_options_are_validated_before_anything_runs(traces, tmp_path, capsys):
    cases = [
        (["--a", "dtype=int7", "--b", "default"], "side A ('dtype=int7'): option dtype='int7': invalid choice 'int7'"),
        (["--a", "max_model_len=1", "--b", "default"], "side A ('max_model_len=1'): max_model_len must be >= 2"),
        (["--a", "default", "--b", "quantization=bogus"], "side B ('quantization=bogus'): "),
        (["--a", "max_model_len=8", "--b", "default"], "exceed max_model_len=8 of side A"),
        (["--a", "file", "--b", "default", "--full-vocab"], "--full-vocab needs both sides"),
        (["--a", "hf:dtype=int3", "--b", "default"], "side A ('hf:dtype=int3')"),
        (["--a", "bad spec", "--b", "default"], "is not understood"),
    ]
    for args, message in cases:
        rc, _, stderr = _run_cli(["diff", "--traces", str(traces), *args, "--out", str(tmp_path / "r")], capsys)
        assert rc == 2 and message in stderr, (args, stderr)
    assert not (tmp_path / "r").exists()
    no_lp = tmp_path / "nolp.jsonl"
    no_lp.write_text('{"id": "q", "prompt_token_ids": [1], "trace_token_ids": [2]}\n')
    with pytest.raises(TraceFileError, match=r"the 'file' side reads stored 'logprobs', which request 'q' \(line 1\)"):
        compare(no_lp, "default", "file")


# -- the engine extension and the docs -------------------------------------------------------------------------
def test_return_full_logprobs_extension():
    llm = LLM(device="cpu", dtype="float32", max_model_len=64, enable_trace_replay=True, skip_tokenizer_init=True)
    params = [SamplingParams(trace_decode_token_ids=[5, 6, 7], logprobs=1, return_full_logprobs=True),
              SamplingParams(trace_decode_token_ids=[8, 9], logprobs=1),
              SamplingParams(temperature=0, max_tokens=2, return_full_logprobs=True)]  # no logprobs asked
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}, {"prompt_token_ids": [9, 9]}],
                        params, use_tqdm=False)
    full = outs[0].outputs[0].full_logprobs
    assert len(full) == 3 and full[0].shape == (llm.llm_engine.model_config.vocab_size,)
    assert full[0].dtype == np.float32
    for row, token, lps in zip(full, [5, 6, 7], outs[0].outputs[0].logprobs):
        assert row[token] == lps[token].logprob  # the very numbers the logprobs came from
        # Normalised up to the fp32 log-normaliser's rounding: a sum of V terms of total 1 (~sqrt(V) roundings).
        assert math.isclose(float(np.log(np.exp(row.astype(np.float64)).sum())), 0.0,
                            abs_tol=rounding_tol(1, terms=row.size))
        assert int((row >= row[token]).sum()) == lps[token].rank
    assert outs[1].outputs[0].full_logprobs is None
    greedy = outs[2].outputs[0]
    assert [int(np.argmax(r)) for r in greedy.full_logprobs] == greedy.token_ids
    with pytest.raises(ValueError, match="return_full_logprobs must be a bool"):
        SamplingParams(return_full_logprobs=1)


def test_docs_list_every_json_key():
    doc = (ROOT / "docs" / "diff.md").read_text()
    for key in TOP_KEYS | SIDE_KEYS | STATS_KEYS | TOKEN_KEYS | FLIP_KEYS | LOCALIZATION_KEYS:
        assert f"`{key}`" in doc, f"docs/diff.md does not document the JSON key {key!r}"
    assert re.search(r"!\[[^\]]*\]\(img/[\w.-]+\.png\)", doc), "docs/diff.md shows no plot"
    for img in re.findall(r"\]\((img/[\w.-]+\.png)\)", doc):
        assert (ROOT / "docs" / img).stat().st_size < 100_000
