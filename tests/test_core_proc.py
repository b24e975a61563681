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
from server_utils import ENGINE_ARGS, RemoteServer, alive, children

from replayllm import LLM, SamplingParams
from replayllm.embedded_model import materialize
from replayllm.entrypoints.cli import main as cli_main

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
def shared_server(tmp_path_factory):
    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay"], tmp_path_factory.mktemp("core"))
    yield srv
    srv.stop()


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
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-5)


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


def test_bench_serve_result_block_without_successes():
    """No request succeeded: the latency rows say n/a instead of failing to format None."""
    from replayllm.entrypoints.bench.serve import format_result

    s = {"completed": 0, "failed": 3, "max_concurrency": None, "duration": 1.0, "total_input_tokens": 0,
         "total_output_tokens": 0, "request_throughput": 0.0, "output_throughput": 0.0, "total_token_throughput": 0.0}
    s |= {f"{stat}_{key}_ms": None for stat in ("mean", "median", "p99") for key in ("ttft", "tpot", "itl", "e2el")}
    text = format_result(s)
    assert "Failed requests:" in text and "Median TTFT (ms):" in text and "n/a" in text
    assert "Maximum request concurrency" not in text


class _FakeClient:
    """What ClientOutputRouter uses of EngineCoreClient: stats, snapshot, utility answers, core aborts."""

    def __init__(self):
        from replayllm.engine.engine_stats import StatsSink

        self.stats, self.snapshot, self.core_aborts = StatsSink(), None, []

    def resolve_call(self, call_id, ok, result):
        raise AssertionError("no utility call was made")

    def send_abort(self, ids):
        self.core_aborts.extend(ids)

    def abort(self, ids):  # RequestStream's engine
        pass


def test_router_detokenizes_cuts_at_stop_strings_and_aborts_in_the_core():
    """The API-server side of the core's messages, no process: text, stop strings (an abort goes to the core),
    logprobs from the flat arrays, FINAL_ONLY, and tokens the core sends after a stop here are dropped."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked
    from replayllm.sampling_params import RequestOutputKind

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    tok = inputs.tokenizer
    ids = tok.encode(" there lived a curious little robot.", add_special_tokens=False)
    fake = _FakeClient()
    router = ClientOutputRouter(inputs, fake)

    async def main():
        loop = asyncio.get_running_loop()
        streams = {}
        for rid, params in (("s", SamplingParams(max_tokens=50, stop=["curious"], logprobs=1)),
                            ("f", SamplingParams(max_tokens=len(ids), output_kind=RequestOutputKind.FINAL_ONLY))):
            streams[rid] = RequestStream(fake, [rid], loop)
            router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2, 3]}, params),
                       Tracked(streams[rid], 0, 1, time.monotonic()))
        for step, t in enumerate(ids):
            last = step == len(ids) - 1
            msg = CoreOutputs(req_ids=["s", "f"], token_ids=[t, t], num_cached_tokens=[0, 0],
                              logprob=[-0.25 * step, -1.0], rank=[step + 1, 1], topk_ids=[[7], [7]],
                              topk_logprobs=[[-0.125], [-0.125]], finished=[("f", "length", None)] if last else [],
                              step_started=time.monotonic(), step_ended=time.monotonic(), num_step_reqs=2,
                              num_step_tokens=2)
            router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))  # through the wire format
        return ([out async for _, out in streams["s"].outputs()], [out async for _, out in streams["f"].outputs()])

    stopped, final = asyncio.run(main())
    comp = stopped[-1].outputs[0]
    assert stopped[-1].finished and comp.finish_reason == "stop" and comp.stop_reason == "curious"
    assert comp.text == " there lived a "
    n = len(comp.token_ids)
    assert comp.token_ids == ids[:n] and "curious" in tok.decode(ids[:n]) and "curious" not in tok.decode(ids[:n - 1])
    assert [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)] == [-0.25 * i for i in range(n)]
    assert [lp[t].rank for lp, t in zip(comp.logprobs, comp.token_ids)] == list(range(1, n + 1))
    assert fake.core_aborts == ["s"]  # the core still ran it: aborted there once, later tokens dropped here
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == tok.decode(ids)
    assert final[0].outputs[0].finish_reason == "length" and not router.tracked and not router.processor.parents


def test_router_takes_a_fast_replay_chunk_as_consecutive_rows():
    """A fast-replay row that sampled n tokens comes as n consecutive wire rows of one request: all n tokens
    with their own logprobs, and the finish (sent for the request) applies after its last row only."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512,
                                         enable_trace_replay=True))
    fake = _FakeClient()
    router = ClientOutputRouter(inputs, fake)
    trace = [11, 12, 13, 14, 15]

    async def main():
        stream = RequestStream(fake, ["t"], asyncio.get_running_loop())
        params = SamplingParams(trace_decode_token_ids=trace, logprobs=1, trace_replay_chunk_size=4)
        router.add("t", inputs.prepare_request({"prompt_token_ids": [1, 2, 3]}, params),
                   Tracked(stream, 0, 1, time.monotonic()))
        for chunk, finished in ((trace[:1], []), (trace[1:], [("t", "length", None)])):  # prefill, then 4 rows
            msg = CoreOutputs(req_ids=["t"] * len(chunk), token_ids=chunk, num_cached_tokens=[0] * len(chunk),
                              logprob=[-t / 10 for t in chunk], rank=[t for t in chunk],
                              topk_ids=[[7]] * len(chunk), topk_logprobs=[[-0.5]] * len(chunk), finished=finished,
                              step_started=time.monotonic(), step_ended=time.monotonic(), num_step_reqs=1,
                              num_step_tokens=len(chunk))
            router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))
        return [out async for _, out in stream.outputs()]

    outs = asyncio.run(main())
    comp = outs[-1].outputs[0]
    assert outs[-1].finished and comp.finish_reason == "length" and comp.token_ids == trace
    assert [lp[t].logprob for lp, t in zip(comp.logprobs, trace)] == [-t / 10 for t in trace]
    assert [lp[t].rank for lp, t in zip(comp.logprobs, trace)] == trace
    assert not router.tracked and not fake.core_aborts


def test_router_coalesces_queued_steps_into_one_delivery_per_request():
    """Steps that queued while the API process was busy (apply_many): each request gets one output carrying every
    step's tokens, the same text and tokens as step-by-step routing; a request that a later message's step error
    ended gets only that error (the tokens routed before it in the same batch are not delivered after it)."""
    from replayllm.config import EngineConfig
    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import CoreOutputs
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import EngineStepError, RequestStream, Tracked

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    ids = inputs.tokenizer.encode(" a robot walked home slowly", add_special_tokens=False)

    def step(rids, t, finished=(), error=None):
        now = time.monotonic()
        return CoreOutputs(req_ids=list(rids), token_ids=[t] * len(rids), num_cached_tokens=[0] * len(rids),
                           finished=list(finished), step_started=now, step_ended=now, num_step_reqs=len(rids),
                           num_step_tokens=len(rids), step_error=error, failed=["a"] if error else [])

    def run(batches):
        """Route `batches` (lists of messages, one apply_many each); per request: deliveries and outputs read."""
        fake = _FakeClient()
        router = ClientOutputRouter(inputs, fake)

        async def main():
            loop, streams, counts = asyncio.get_running_loop(), {}, {}
            for rid in ("a", "b"):
                streams[rid] = stream = RequestStream(fake, [rid], loop)
                counts[rid] = 0

                def deliver(index, item, _deliver=stream.deliver, rid=rid):
                    counts[rid] += 1
                    _deliver(index, item)

                stream.deliver = deliver
                router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=64)),
                           Tracked(stream, 0, 1, time.monotonic()))
            for batch in batches:
                router.apply_many(batch)
            outs = {}
            for rid, stream in streams.items():
                try:
                    outs[rid] = [out async for _, out in stream.outputs()]
                except EngineStepError as e:
                    outs[rid] = e
            return counts, outs

        return asyncio.run(main())

    msgs = [step("ab", t) for t in ids[:-1]] + [step("ab", ids[-1], [("a", "length", None), ("b", "length", None)])]
    one_by_one = run([[m] for m in msgs])
    together = run([msgs[:3], msgs[3:]])
    assert one_by_one[0] == {"a": len(ids), "b": len(ids)} and together[0] == {"a": 2, "b": 2}
    for rid in "ab":
        final = together[1][rid][-1].outputs[0]
        assert final.token_ids == ids and final.text == one_by_one[1][rid][-1].outputs[0].text
        assert final.text == inputs.tokenizer.decode(ids) and together[1][rid][-1].finished
    failed = run([[step("ab", ids[0]), step("b", ids[1]), step([], 0, error="boom")],
                  [step("b", ids[2], [("b", "length", None)])]])
    assert failed[0]["a"] == 1 and isinstance(failed[1]["a"], EngineStepError)  # the error only
    assert failed[1]["b"][-1].outputs[0].token_ids == ids[:3] and failed[0]["b"] == 2


def test_output_reader_routes_the_steps_that_queued_in_one_call(tmp_path):
    """EngineCoreClient's output reader: the messages already waiting on the socket when it wakes are routed by
    one apply_many call (one delivery per request for all of them); a message arriving alone goes alone."""
    import zmq
    import zmq.asyncio

    from replayllm.config import EngineConfig
    from replayllm.engine.core_client import EngineCoreClient
    from replayllm.engine.core_messages import ENCODER, CoreOutputs

    client = EngineCoreClient(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    calls = []

    class Recorder:
        def apply_many(self, msgs):
            calls.append([m.num_step_reqs for m in msgs])

    client._router = Recorder()
    path = f"ipc://{tmp_path}/out"

    async def main():
        ctx = zmq.asyncio.Context()
        client._output = ctx.socket(zmq.PULL)
        client._output.bind(path)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(path)
        try:
            for n in (1, 2, 3):  # three steps queue up before the reader runs
                push.send(ENCODER.encode(CoreOutputs(num_step_reqs=n)))
            deadline = time.monotonic() + 30
            while not await client._output.poll(0) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # all three delivered to the PULL socket (ipc: microseconds)
            reader = asyncio.create_task(client._read_outputs())
            while not calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            push.send(ENCODER.encode(CoreOutputs(num_step_reqs=4)))
            while len(calls) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            reader.cancel()
        finally:
            push.close(linger=0)
            client._output.close(linger=0)
            ctx.term()

    asyncio.run(main())
    assert calls == [[1, 2, 3], [4]]
