"""`replayllm diff` / `capture` refuse a bad value before any side runs (or any engine starts), in one line: --out,
non-finite thresholds, --fail-above, what the engine would refuse of a side, the trace file's top-k, --model."""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

import pytest

import replayllm.entrypoints.diff as diff_pkg
from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import SpecError, TraceFileError, compare
from replayllm.entrypoints.diff.side_checks import CheckedSide, check_vocab_sizes

# the module (the package's attribute `compare` is the function of the same name)
compare_module = sys.modules["replayllm.entrypoints.diff.compare"]

LINE = {"id": "a", "prompt_token_ids": [1, 2, 3], "trace_token_ids": [5, 6], "logprobs": [-1.0, -2.0],
        "top_logprobs": [{"5": -1.0, "9": -1.5}, {"6": -2.0}]}


def _write(path: Path, *lines: dict) -> Path:
    path.write_text("".join(json.dumps(obj) + "\n" for obj in lines))
    return path


@pytest.fixture
def traces(tmp_path) -> Path:
    return _write(tmp_path / "t.jsonl", LINE)


@pytest.fixture
def no_run(monkeypatch):
    """Fails the test if a side starts running (compare()'s scoring, or the CLI's compare / capture_run)."""
    def boom(*args, **kwargs):
        raise AssertionError("a side ran")

    monkeypatch.setattr(compare_module, "_score_sides", boom)
    monkeypatch.setattr(diff_pkg, "capture_run", boom)


def _cli(args: list[str], capsys) -> tuple[int, str]:
    rc = main(args)
    return rc, capsys.readouterr().err


def _one_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


# -- finding 1: --out -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("out, message", [("afile", "it is an existing file, not a folder"),
                                          ("/proc/nope", "cannot write the report to '/proc/nope'")])
def test_a_bad_out_is_refused_before_the_sides_run(traces, tmp_path, capsys, monkeypatch, out, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(diff_pkg, "compare", lambda *a, **k: pytest.fail("compare ran"))
    rc, err = _cli(["diff", "--traces", str(traces), "--a", "file", "--b", "file", "--out", out], capsys)
    assert rc == 2 and message in _one_error(err)


def test_a_failed_run_removes_only_the_folder_it_created(traces, tmp_path, capsys):
    kept = tmp_path / "kept"
    kept.mkdir()
    for out in (kept, tmp_path / "new"):
        rc, err = _cli(["diff", "--traces", str(traces), "--a", "file", "--b", "nope", "--out", str(out)], capsys)
        assert rc == 2 and "is not understood" in _one_error(err)
    assert kept.is_dir() and not (tmp_path / "new").exists()


def test_capture_refuses_an_unwritable_out_before_generating(tmp_path, capsys, no_run):
    (tmp_path / "p.txt").write_text("hi\n")
    for out, message in (("/proc/x.jsonl", "cannot write the trace file '/proc/x.jsonl'"),
                         (str(tmp_path), "it is a folder"), (str(tmp_path / "no" / "t.jsonl"), "no folder")):
        rc, err = _cli(["capture", "--prompts", str(tmp_path / "p.txt"), "--out", out], capsys)
        assert rc == 2 and message in _one_error(err), out


# -- findings 2, 3: non-finite and negative numbers ---------------------------------------------------------------
@pytest.mark.parametrize("option, message", [({"threshold": math.inf}, "threshold must be a finite number >= 0"),
                                             ({"noise_factor": math.inf}, "noise_factor must be a finite number > 0")])
def test_infinite_thresholds_are_refused_up_front(traces, no_run, option, message):
    with pytest.raises(ValueError, match=message):
        compare(traces, "file", "file", **option)


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_fail_above_must_be_a_finite_number_at_least_zero(traces, tmp_path, capsys, monkeypatch, value):
    monkeypatch.setattr(diff_pkg, "compare", lambda *a, **k: pytest.fail("compare ran"))
    rc, err = _cli(["diff", "--traces", str(traces), "--a", "file", "--b", "file", "--fail-above", value,
                    "--out", str(tmp_path / "r")], capsys)
    assert rc == 2 and "--fail-above must be a finite number >= 0" in _one_error(err)


# -- finding 4: what the engine would refuse, named by side and flag ---------------------------------------------
@pytest.mark.parametrize("a, b, top_k, message", [
    ("default", "default", 10**7, "side A ('default'): --top-k 10000000 is more than the model's vocabulary"),
    ("hf", "default", 10**7, "side A ('hf'): --top-k 10000000 is more than the model's vocabulary"),
    ("default", "max_logprobs=2", 20, "side B ('max_logprobs=2'): max_logprobs=2 is less than the --top-k 20"),
    ("file", "num_gpu_blocks_override=1", 20, "side B ('num_gpu_blocks_override=1'): num_gpu_blocks_override=1 "
                                             "blocks of 16 tokens are fewer than one sequence"),
])
def test_values_the_engine_refuses_are_named_before_any_side_runs(traces, no_run, a, b, top_k, message):
    with pytest.raises(SpecError) as e:
        compare(traces, a, b, top_k=top_k)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_full_vocab_needs_one_vocabulary_size():
    sides = (diff_pkg.parse_spec("default"), diff_pkg.parse_spec("hf:model=other"))
    with pytest.raises(SpecError, match=r"side A \('default'\) has 1024 tokens, side B \('hf:model=other'\) 2048"):
        check_vocab_sizes((CheckedSide({}, 1024), CheckedSide({}, 2048)), sides)
    check_vocab_sizes((CheckedSide({}, 1024), CheckedSide({}, 1024)), sides)


# -- finding 6: top_logprobs against the vocabulary and as probabilities --------------------------------------------
def test_top_logprobs_ids_outside_the_vocabulary_name_the_file_and_line(tmp_path, no_run):
    path = _write(tmp_path / "oov.jsonl", {**LINE, "top_logprobs": [{"99999999": -0.5}, {"6": -2.0}]})
    with pytest.raises(TraceFileError) as e:
        compare(path, "file", "default")
    assert f"{path} line 1: request 'a': top_logprobs[0] holds token ids outside the model's vocabulary" in str(e.value)
    assert "[99999999]" in str(e.value)


def test_a_top_k_holding_more_than_all_the_probability_is_refused(tmp_path):
    path = _write(tmp_path / "mass.jsonl", {**LINE, "top_logprobs": [{"5": -0.1, "7": -0.1, "8": -0.1}, {"6": -2.0}]})
    with pytest.raises(TraceFileError, match=r"line 1: top_logprobs\[0\]: its probabilities sum to 2.71"):
        diff_pkg.read_traces(path)
    # A truncated top-k sums to less than 1; a whole distribution to 1 up to rounding: both are read.
    full = {"5": math.log(0.5), "7": math.log(0.25), "8": math.log(0.25) + 5e-5}
    _write(path, {**LINE, "top_logprobs": [{"5": 0.0, "7": -4.0, "8": -4.5}, {"6": -2.0}]})  # a bf16 top-1 of 0.0
    assert len(diff_pkg.read_traces(path)) == 1  # sums to 1.03: rounding, read
    _write(path, {**LINE, "top_logprobs": [full, {"6": -2.0}]})
    assert diff_pkg.read_traces(path)[0].top_logprobs[0][7] == math.log(0.25)


# -- finding 7: MODEL omitted while the trace names another model -------------------------------------------------
def test_a_trace_of_another_model_warns_when_model_is_omitted(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", {"provenance": {"model": "models/llama"}}, LINE)
    rc, err = _cli(["diff", "--traces", str(path), "--a", "file", "--b", "file", "--out", str(tmp_path / "r")],
                   capsys)
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert rc == 0 and len(warning) == 1
    assert "embedded model 'replayllm/tiny-qwen3'" in warning[0] and "names 'models/llama'" in warning[0]
    with pytest.warns(diff_pkg.job.DiffWarning, match="names 'models/llama'"):
        compare(path, "file", "file")
    # The embedded model named by its id or its folder, or MODEL given: nothing to warn about.
    from replayllm.config import ModelConfig

    folder = ModelConfig.from_pretrained("replayllm/tiny-qwen3").path
    for named, model in (("replayllm/tiny-qwen3", None), (folder, None), ("models/llama", "replayllm/tiny-qwen3")):
        _write(path, {"provenance": {"model": named}}, LINE)
        with warnings.catch_warnings():
            warnings.simplefilter("error", diff_pkg.job.DiffWarning)
            compare(path, "file", "file", model=model)


# -- finding 8: --model, vLLM's spelling --------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["diff", "--traces", "t.jsonl", "--a", "file", "--b", "file"],
                                     ["capture", "--prompts", "p.txt", "--out", "o.jsonl"],
                                     ["replay", "--traces", "t.jsonl", "--out", "o.jsonl"], ["generate"]])
def test_model_flag_is_accepted_and_must_agree_with_the_positional(command, capsys):
    from replayllm.entrypoints.cli.main import build_parser
    from replayllm.entrypoints.cli.serve_compat_args import resolve_model_option

    args = build_parser(command[0]).parse_args([*command, "--model", "m/x"])
    resolve_model_option(args)
    assert args.model == "m/x"
    rc, err = _cli([command[0], "m/y", *command[1:], "--model", "m/x"], capsys)
    assert rc == 2 and "the positional MODEL ('m/y') and --model ('m/x') differ" in _one_error(err)


# -- finding 14: a model that is neither a folder nor a hub model -------------------------------------------------
def test_a_missing_model_is_one_line(traces, no_run, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network wait; the message is the same either way
    with pytest.raises(SpecError) as e:
        compare(traces, "model=models/nonexistent", "file")
    assert str(e.value) == ("side A ('model=models/nonexistent'): no such local folder 'models/nonexistent', and not "
                            "a hub model found online or in the Hugging Face cache")
    with pytest.raises(ValueError) as e:
        compare(traces, "file", "file", model="models/nonexistent")
    assert str(e.value).startswith("MODEL: no such local folder 'models/nonexistent'") and "\n" not in str(e.value)
