"""The README's three workflows, run as written: the Python example, the curl request (against a shared
`replayllm serve --enable-trace-replay`), and capture -> diff in a scratch folder."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import httpx

from replayllm.entrypoints.cli.main import build_parser
from replayllm.entrypoints.cli.main import main as cli_main

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
TRACE = [1052, 12163, 264]


def _blocks(lang: str) -> list[str]:
    return re.findall(r"```" + lang + r"\n(.*?)```", README, re.S)


def _block_with(word: str) -> str:
    (block,) = [b for b in _blocks("bash") if word in b]
    return block


def test_python_example_replays_the_trace(capsys):
    namespace: dict = {}
    exec(compile(_blocks("python")[0], "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    out = namespace["out"]
    assert list(out.token_ids) == TRACE == namespace["params"].trace_decode_token_ids
    assert all(out.logprobs[i][t].rank >= 1 for i, t in enumerate(TRACE))
    assert len(capsys.readouterr().out.splitlines()) == len(TRACE)  # one printed line per trace token


def test_http_example(shared_open_trace_server):
    block = _block_with("curl")
    serve_line = next(line for line in block.splitlines() if line.startswith("replayllm serve"))
    serve_args = shlex.split(serve_line.split("&")[0])[1:]
    assert build_parser().parse_args(serve_args).enable_trace_replay  # the command as written parses
    # shared_open_trace_server is that command (on the CPU, fp32) on a free port.
    curl = block[block.index("curl"):].strip().replace("http://127.0.0.1:8000", shared_open_trace_server.url)
    if shutil.which("curl"):
        answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, check=True).stdout)
    else:  # the same request body, sent by httpx
        body = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
        answer = httpx.post(shared_open_trace_server.url + "/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(TRACE)
    assert answer["usage"]["completion_tokens"] == len(TRACE)


def test_capture_then_diff(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for line in _block_with("replayllm diff").strip().splitlines():
        if line.startswith("replayllm "):
            assert cli_main(shlex.split(line)[1:]) == 0, line
        else:
            subprocess.run(["bash", "-c", line], check=True)
    assert len((tmp_path / "prompts.txt").read_text().splitlines()) == 2
    traces = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert sum("trace_token_ids" in t for t in traces) == 2  # one trace per prompt (plus a header line)
    report = tmp_path / "fp32-vs-bf16"
    assert (report / "summary.md").exists() and (report / "report.html").exists()
    result = json.loads((report / "diff.json").read_text())
    assert result["overall"]["num_tokens"] == 32  # 2 prompts x 16 tokens, each compared
