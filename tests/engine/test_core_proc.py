"""The engine core in its own process (`replayllm serve`): faults (core killed, SIGTERM, start-up failure),
concurrent trace requests against the offline LLM, and `replayllm bench serve` against a CPU server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers.server_utils import ENGINE_ARGS, RemoteServer, alive, children
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams
from replayllm.embedded_model import materialize
from replayllm.entrypoints.cli.main import main as cli_main

MODEL = "replayllm/tiny-qwen3"
LONG = {"model": MODEL, "prompt": [12522, 5193, 264, 882], "max_tokens": 480, "ignore_eos": True,
        "temperature": 0}
DEADLINE_S = 60.0  # generous: a loaded 2-core CI machine (the bound is 5 s on a quiet one)


def _core_pid(server: RemoteServer) -> int:
    """The engine core: the server's spawned child (the other one is multiprocessing's resource tracker)."""
    kids = [k for k in children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    assert len(kids) == 1, f"expected one engine core process under the server, found {kids}"
    return kids[0]


def _wait(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.1)


@pytest.fixture
def server(tmp_path):
    """A server of its own (the fault tests end it)."""
    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay"], tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shared_server(shared_open_trace_server):
    return shared_open_trace_server


def _stream_events(server, body: dict, out: list, started: asyncio.Event | None = None):
    async def run():
        async with httpx.AsyncClient(timeout=DEADLINE_S * 2) as c:
            async with c.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as r:
                out.append(r.status_code)
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])
                        if started is not None and len(out) > 3:
                            started.set()
    return run()


def test_killed_core_fails_requests_in_flight_and_the_server_exits(server):
    core = _core_pid(server)
    events: list = []

    async def scenario():
        started = asyncio.Event()
        stream = asyncio.create_task(_stream_events(server, LONG, events, started))
        async with httpx.AsyncClient(timeout=DEADLINE_S * 2) as c:
            plain = asyncio.create_task(c.post(server.base_url + "/completions", json=LONG))
            await asyncio.wait_for(started.wait(), DEADLINE_S)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            response = await asyncio.wait_for(plain, DEADLINE_S)
            await asyncio.wait_for(stream, DEADLINE_S)
            return response, time.monotonic() - killed

    response, _ = asyncio.run(scenario())
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_unavailable"
    assert "engine core process died" in response.json()["error"]["message"]
    assert events[0] == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable"
    assert all("choices" in json.loads(e) for e in events[1:-2])  # tokens streamed before the kill
    server.proc.wait(timeout=DEADLINE_S)
    assert server.proc.returncode not in (0, None)
    assert "the engine core process died" in server.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_with_requests_in_flight_leaves_no_process(server, sig):
    """SIGTERM (a supervisor) or SIGINT (Ctrl-C) on the server stops the core and every other child too."""
    core = _core_pid(server)
    kids = children(server.proc.pid)  # the core and multiprocessing's resource tracker
    events: list = []

    async def scenario():
        started = asyncio.Event()
        stream = asyncio.create_task(_stream_events(server, LONG, events, started))
        await asyncio.wait_for(started.wait(), DEADLINE_S)
        server.proc.send_signal(sig)
        try:
            await asyncio.wait_for(stream, DEADLINE_S)
        except httpx.HTTPError:
            pass  # the connection may be cut when the graceful-shutdown period ends

    asyncio.run(scenario())
    server.proc.wait(timeout=DEADLINE_S)
    assert core in kids
    _wait(lambda: not any(map(alive, kids)), "the server's child processes exiting")
    # uvicorn re-raises the signal once it has shut down (the CLI turns a KeyboardInterrupt into 130)
    assert server.proc.returncode in (0, -sig, 130)


def test_sigterm_to_the_server_then_its_process_group_exits(server):
    """`timeout` (and a supervisor stopping a process group) sends SIGTERM to the server, then to every process of
    its group: the core stops by itself, and the server's shutdown used to block forever sending it SHUTDOWN (a
    PUSH socket with no peer left); now it exits."""
    core = _core_pid(server)
    server.proc.send_signal(signal.SIGTERM)
    for pid in (server.proc.pid, *children(server.proc.pid)):  # the group: the server, its core, the tracker
        os.kill(pid, signal.SIGTERM)
    server.proc.wait(timeout=DEADLINE_S)
    assert server.proc.returncode in (0, -signal.SIGTERM, 130)
    _wait(lambda: not alive(core), "the core exiting")


def test_core_profile_env_writes_the_core_loops_stats(tmp_path):
    """REPLAYLLM_CORE_PROFILE=PATH: the engine core's loop runs under cProfile and its stats land at PATH (+ the
    top functions in PATH.txt) when the server stops."""
    path = tmp_path / "core.prof"
    srv = RemoteServer(ENGINE_ARGS, tmp_path, env={"REPLAYLLM_CORE_PROFILE": str(path)})
    try:
        r = httpx.post(srv.base_url + "/completions", json={"model": "replayllm/tiny-qwen3", "prompt": "Hi",
                                                           "max_tokens": 4}, timeout=DEADLINE_S)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    assert path.exists(), srv.log()
    import pstats

    profiled = {(os.path.basename(f), name): calls for (f, _, name), (_, calls, *_) in
                pstats.Stats(str(path)).stats.items()}
    assert profiled.get(("core_proc.py", "_step"), 0) >= 4  # a step per token, at least
    assert "function calls" in (tmp_path / "core.prof.txt").read_text()


def test_core_start_up_failure_is_a_clear_error(tmp_path):
    model = tmp_path / "no-weights"
    shutil.copytree(materialize(MODEL), model)
    for f in model.glob("*.safetensors"):
        f.unlink()  # the config (checked in the API server) is fine; the weights (loaded in the core) are gone
    cmd = [sys.executable, "-m", "replayllm.entrypoints.cli", "serve", str(model), *ENGINE_ARGS,
           "--host", "127.0.0.1", "--port", "0"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: the engine could not start" in out.stderr


def test_tokenizer_loads_while_the_core_starts_and_its_failure_stops_the_core(monkeypatch):
    """start_core spawns the core first, then loads this process's tokenizer (the two overlap); a tokenizer
    that fails to load leaves no core process behind."""
    from replayllm.config import EngineConfig
    from replayllm.engine import core_client

    client = core_client.EngineCoreClient(EngineConfig(model=MODEL, device="cpu", max_model_len=64))
    assert client._inputs is None  # nothing loaded before start_core
    spawned = []

    def failing_tokenizer(config):
        spawned.append(client._proc.pid)  # the core is already starting when the tokenizer loads
        raise OSError("tokenizer.json is corrupt")

    monkeypatch.setattr(core_client, "InputProcessor", failing_tokenizer)
    with pytest.raises(OSError, match="corrupt"):
        client.start_core()
    assert spawned and not alive(spawned[0])
    client.close()


def test_shutdown_terminates_both_zeromq_contexts():
    """EngineCoreClient.shutdown stops the core and terminates the ZeroMQ contexts of its input and output sockets
    (one I/O thread each): a process that starts and stops servers in a loop keeps no threads behind."""
    from replayllm.config import EngineConfig
    from replayllm.engine.core_client import EngineCoreClient

    client = EngineCoreClient(EngineConfig(model=MODEL, device="cpu", max_model_len=64))

    async def scenario():
        client.start()
        contexts = [client._zmq, client._out_zmq]
        assert len({id(c) for c in contexts}) == 2 and not any(c.closed for c in contexts)
        await client.shutdown()
        return contexts

    contexts = asyncio.run(scenario())
    assert all(c.closed for c in contexts)
    assert not alive(client.core_pid)
    client.close()  # idempotent


def test_concurrent_trace_requests_equal_offline_llm(shared_server):
    server = shared_server
    llm = LLM(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=512)
    prompts = [[12522, 5193, 264, 882, 100 + i] for i in range(6)]
    traces = [[(7 * i + 13 * j) % 5000 + 200 for j in range(12)] for i in range(6)]
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces], use_tqdm=False)

    async def all_at_once():
        async with httpx.AsyncClient(timeout=DEADLINE_S * 2) as c:
            rs = await asyncio.gather(*(c.post(server.base_url + "/completions", json={
                "model": MODEL, "prompt": p, "trace_decode_token_ids": t, "logprobs": 1, "return_token_ids": True})
                for p, t in zip(prompts, traces)))
        return [r.json()["choices"][0] for r in rs]

    for ref, got, trace in zip(offline, asyncio.run(all_at_once()), traces):
        comp = ref.outputs[0]
        assert got["token_ids"] == comp.token_ids == trace
        assert got["text"] == comp.text
        want = [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]
        # Concurrent requests vs one offline batch: other batch compositions, another summation order.
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want, abs=LOGPROB_TOL, rel=0)


def test_bench_serve_against_a_cpu_server(shared_server, tmp_path, capsys):
    server = shared_server
    for trace in (False, True):
        result = tmp_path / f"bench-{trace}.json"
        # With a concurrency cap, and without one (the default: all at once; no "Maximum request concurrency").
        cap = ["--max-concurrency", "4"] if trace else []
        argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "8",
                "--random-output-len", "5", "--ignore-eos", *cap, "--vocab-size", "4000",
                "--seed", "3", "--save-result", str(result), *(["--trace"] if trace else [])]
        assert cli_main(argv) == 0
        printed = capsys.readouterr().out
        assert "Serving Benchmark Result" in printed and "Median TPOT (ms):" in printed
        assert ("Maximum request concurrency:" in printed) is bool(cap)
        summary = json.loads(result.read_text())
        assert summary["completed"] == 6 and summary["failed"] == 0 and summary["trace"] is trace
        assert summary["total_output_tokens"] == 30 and summary["total_input_tokens"] == 48
        assert summary["median_ttft_ms"] > 0 and summary["mean_tpot_ms"] > 0 and summary["request_throughput"] > 0
        assert all(r["output_tokens"] == 5 for r in summary["per_request"])
        # The client's own send queue, inside each TTFT (aiohttp's trace hook saw every body leave).
        assert all(0 < r["send_delay"] < r["ttft"] for r in summary["per_request"])
        assert 0 < summary["median_send_delay_ms"] < summary["median_ttft_ms"]
        assert summary["model_id"] == summary["tokenizer_id"] == summary["model"]  # vLLM's names too
        assert summary["request_rate"] == "inf"  # vLLM's string: a bare Infinity is no JSON (strict parsers refuse it)
    assert "Infinity" not in result.read_text()
    # a model the server does not serve is refused (it used to benchmark the served one quietly)
    assert cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--model", "nosuch"]) == 2
    assert "--model 'nosuch' is not served" in capsys.readouterr().err
    assert cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--served-model-name", "x"]) == 2
    assert "--served-model-name 'x' is not served" in capsys.readouterr().err


def test_bench_serve_with_vllms_spellings(shared_server, tmp_path, capsys):
    """vLLM's `bench serve` flags: --backend vllm, --tokenizer (ids below its vocabulary), --random-range-ratio
    (lengths drawn around the given ones), --percentile-metrics / --metric-percentiles (the printed block and the
    JSON), --save-result with --result-dir (created when missing) and --result-filename."""
    from replayllm.embedded_model import DEFAULT_MODEL, materialize

    result_dir = tmp_path / "not" / "yet"
    argv = ["bench", "serve", "--base-url", shared_server.url, "--backend", "vllm", "--tokenizer",
            materialize(DEFAULT_MODEL), "--num-prompts", "8", "--random-input-len", "8", "--random-output-len", "4",
            "--random-range-ratio", "0.5", "--ignore-eos", "--seed", "5", "--percentile-metrics", "ttft,e2el",
            "--metric-percentiles", "50,90", "--save-result", "--result-dir", str(result_dir),
            "--result-filename", "run.json"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "P90 TTFT (ms):" in printed and "P50 E2EL (ms):" in printed
    assert "TPOT" not in printed and "P99" not in printed  # only the metrics and percentiles asked for
    summary = json.loads((result_dir / "run.json").read_text())
    assert summary["backend"] == "vllm" and summary["completed"] == 8
    assert summary["p50_ttft_ms"] <= summary["p90_ttft_ms"] and "p90_tpot_ms" in summary
    in_lens = [r["prompt_len"] for r in summary["per_request"]]
    out_lens = [r["output_tokens"] for r in summary["per_request"]]
    assert all(4 <= n <= 12 for n in in_lens) and len(set(in_lens)) > 1  # 8 x [0.5, 1.5], not all the same
    assert all(2 <= n <= 6 for n in out_lens) and summary["total_output_tokens"] == sum(out_lens)


def test_bench_serve_text_prompts(shared_server, tmp_path, capsys, monkeypatch):
    """--text-prompts sends the text the random ids decode to (vLLM's random dataset): every request is a string
    prompt the server tokenizes, and the input tokens counted are the server's (the usage chunk)."""
    from replayllm.embedded_model import DEFAULT_MODEL, materialize
    from replayllm.entrypoints.bench import serve, serve_prompts

    argv = ["bench", "serve", "--base-url", shared_server.url, "--tokenizer", materialize(DEFAULT_MODEL),
            "--text-prompts", "--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "3",
            "--ignore-eos", "--seed", "2", "--save-result", str(tmp_path / "text.json")]
    sent = []
    make = serve_prompts.make_bodies

    def spy(args, model):
        sent.extend(make(args, model))
        return sent

    monkeypatch.setattr(serve, "make_bodies", spy)
    assert cli_main(argv) == 0
    assert len(sent) == 4 and all(isinstance(b["prompt"], str) and b["prompt"] for b in sent)
    summary = json.loads((tmp_path / "text.json").read_text())
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 12
    lens = [r["prompt_len"] for r in summary["per_request"]]
    assert all(n > 0 for n in lens) and summary["total_input_tokens"] == sum(lens)  # the server's counts
    assert cli_main(["bench", "serve", "--port", "9", "--text-prompts"]) == 2  # no --tokenizer: refused at once
    assert "--text-prompts decodes the random ids with --tokenizer" in capsys.readouterr().err


def test_bench_serve_refuses_an_unusable_result_dir_before_sending(tmp_path, capsys):
    """A --result-dir that cannot be created fails before any request (exit 2; no server needed to see it)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["bench", "serve", "--port", "9", "--num-prompts", "1", "--save-result", "--result-dir",
            str(blocker / "sub")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--result-dir" in err and "cannot reach the server" not in err
    assert cli_main(["bench", "serve", "--port", "9", "--save-result", str(tmp_path / "no" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err  # a --save-result FILE whose folder is missing: at once
    assert cli_main(["bench", "serve", "--port", "9", "--metric-percentiles", "abc"]) == 2
    assert "--metric-percentiles" in capsys.readouterr().err
    assert cli_main(["bench", "serve", "--port", "9", "--percentile-metrics", "ttft,foo"]) == 2
    assert "--percentile-metrics" in capsys.readouterr().err


def test_bench_serve_reads_openai_api_key(monkeypatch):
    """vLLM's bench clients send $OPENAI_API_KEY; REPLAYLLM_API_KEY wins where both are set."""
    from replayllm.entrypoints.cli.main import build_parser
    monkeypatch.delenv("REPLAYLLM_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "k1")
    assert build_parser("bench").parse_args(["bench", "serve"]).api_key == "k1"
    monkeypatch.setenv("REPLAYLLM_API_KEY", "k2")
    assert build_parser("bench").parse_args(["bench", "serve"]).api_key == "k2"


def test_bench_serve_result_block_without_successes():
    """No request succeeded: the latency rows say n/a instead of failing to format None."""
    from replayllm.entrypoints.bench.serve import format_result

    s = {"completed": 0, "failed": 3, "max_concurrency": None, "duration": 1.0, "total_input_tokens": 0,
         "total_output_tokens": 0, "request_throughput": 0.0, "output_throughput": 0.0, "total_token_throughput": 0.0}
    s |= {f"{stat}_{key}_ms": None for stat in ("mean", "median", "p99") for key in ("ttft", "tpot", "itl", "e2el")}
    text = format_result(s)
    assert "Failed requests:" in text and "Median TTFT (ms):" in text and "n/a" in text
    assert "Maximum request concurrency" not in text


def test_bench_serve_without_a_server_is_a_clear_error(capsys):
    """No server on the port: one `error:` line naming the URL and exit status 2 (the CLI's bad-input status),
    not a traceback."""
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free_port = sock.getsockname()[1]
    assert cli_main(["bench", "serve", "--port", str(free_port), "--num-prompts", "1"]) == 2
    assert "cannot reach the server at" in capsys.readouterr().err


def test_an_early_core_keeps_sigterms_default_until_its_config_comes(monkeypatch):
    """EarlyCore.cancel terminates a core that is still importing: with the default action it just ends. The
    SystemExit handler raised inside the import machinery printed an "Exception ignored ... Traceback" on the
    server's stderr, and the imports went on (a CI run caught it). The handler is installed once the config came."""
    from replayllm.engine import core_proc

    seen = []
    monkeypatch.setattr(core_proc, "die_with_parent", lambda: None)
    monkeypatch.setattr(core_proc, "_config_from_api",
                        lambda ready, conf: seen.append(signal.getsignal(signal.SIGTERM)) or (None, "", 0))
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        core_proc.run_engine_core(None, "in", "out", os.getpid(), ready_conn=None, config_conn=None)
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
    assert seen == [signal.SIG_DFL]
