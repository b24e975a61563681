"""The `replayllm` command line: --version, `generate` (free and replayed), Ctrl-C, `serve`'s port check."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from replayllm import __version__
from replayllm.entrypoints.cli.main import INTERRUPTED, main

CPU = ["--device", "cpu", "--dtype", "float32"]


def _ranks(stdout: str) -> list[int]:
    """The rank column of `generate`'s per-token table (pos, token, text, logprob, rank, top-1 alternative)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("pos")) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("text: "))
    return [int(re.search(r" (-?\d+\.\d{4}|-inf) +(\d+)  ", line).group(2)) for line in lines[start:end]]


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main([flag])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == __version__


def test_generate_without_a_trace_is_greedy_generation(capsys):
    assert main(["generate", *CPU, "--max-tokens", "4", "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "generated 4 tokens (temperature 0)" in out
    assert _ranks(out) == [1, 1, 1, 1]  # greedy: every token is the most likely one
    assert "replayed" not in out


def test_generate_sampling_is_seeded(capsys):
    args = ["generate", *CPU, "--max-tokens", "5", "--temperature", "1.0", "--seed", "7"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_demo_replays_the_demo_sentence(capsys):
    assert main(["generate", *CPU, "--demo", "--logprobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "replayed 7 trace tokens" in out
    assert "text: ' there lived a curious little robot.'" in out


@pytest.mark.parametrize("args, message", [
    (["--trace", "1,abc"], "argument --trace: expected comma-separated token ids"),
    (["--trace", "1,-2"], "argument --trace: token ids must be >= 0"),
    (["--trace", "1", "--demo"], "not allowed with argument"),
])
def test_generate_bad_trace_names_the_flag(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_generate_rejects_sampling_flags_with_a_trace(capsys):
    assert main(["generate", *CPU, "--demo", "--temperature", "0.5"]) == 2
    assert "--temperature and --max-tokens are for free generation" in capsys.readouterr().err


@pytest.mark.parametrize("command, target", [
    (["diff", "--traces", "t.jsonl", "--a", "file", "--b", "default"], "replayllm.entrypoints.diff.compare"),
    (["capture", "--prompts", "p.txt", "--out", "t.jsonl"], "replayllm.entrypoints.diff.capture_run"),
    (["generate"], "replayllm.entrypoints.llm.LLM.__init__"),
])
def test_ctrl_c_exits_130_with_one_line(command, target, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.txt").write_text("Once upon a time\n")
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(target, interrupted)
    assert main(command) == INTERRUPTED == 130
    captured = capsys.readouterr()
    assert captured.err == "interrupted\n"


def test_serve_on_a_taken_port_fails_before_loading_the_model(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model path that does not exist: had the model been loaded first, the error would be about it.
        out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", str(tmp_path / "nope"),
                              "--host", "127.0.0.1", "--port", str(port)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    assert "Traceback" not in out.stderr
