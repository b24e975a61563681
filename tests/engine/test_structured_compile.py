"""Bounded grammar compilation (issue 31): request caps before any compile, a compile timeout that kills the
compile process, abandoned compiles stopped, other streams' steps unaffected while a big grammar compiles, and
a byte-bounded LRU of compiled grammars."""

from __future__ import annotations

import statistics
import time

import pytest

from replayllm import LLM, SamplingParams, StructuredOutputsParams
from replayllm.config import EngineConfig
from replayllm.engine.grammar_compiler import CompiledGrammarCache, GrammarKey
from replayllm.entrypoints.http.limits import RequestLimits

pytestmark = pytest.mark.serial  # stream gaps while a grammar compiles, compile timeouts: `make test` runs it alone

pytest.importorskip("xgrammar")

# ~100-character entries: xgrammar's compile grows faster than linearly with them (3,000 took ~7 s on the 2-core
# CPU machine, 1,000 ~1 s); 6,000 runs far longer than any window below, whatever the machine.
BIG_CHOICE = [f"option {i} " + " ".join(f"w{(i * j * 7919) % 100003}" for j in range(15)) for i in range(6000)]
# How much slower the other stream's steps may get while a big grammar compiles. The compile runs in a child
# process at nice +10 (CFS weight 110 against the engine's 1024: >= 90% of a shared core stays the engine's) and
# holds no lock of this process; 4x leaves room for the other sessions that load this 2-core machine at random.
# Before this change (compile threads in this process at the engine's priority) the probe saw 18x.
MAX_GAP_RATIO = 4.0


@pytest.fixture(scope="module")
def llm():
    llm = LLM(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=8, async_scheduling=False)
    # Started and warm (TokenizerInfo built, the worker process ready): later timings measure compiles only.
    out = llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"])))
    assert out[0].outputs[0].text in ("yes", "no")
    return llm


def _service(llm):
    return llm.llm_engine.structured.service


def _wait_dead(proc, timeout: float = 10.0) -> float:
    start = time.monotonic()
    while proc.poll() is None:
        assert time.monotonic() - start < timeout, "the compile process is still running"
        time.sleep(0.01)
    return time.monotonic() - start


def test_compile_timeout_fails_the_request_and_kills_the_compile(llm):
    service = _service(llm)
    service.timeout_s = 0.5  # read per compile
    try:
        worker = service._worker.proc
        killed = service.num_killed
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=BIG_CHOICE))
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"^structured_outputs: grammar compilation timed out after 0.5 s"):
            llm.generate(["Hi"], params)
        # Failed within the timeout plus the engine's 50 ms waits and the kill: not after the compile's seconds.
        assert time.monotonic() - start < 0.5 + 5.0
        assert service.num_killed == killed + 1
        _wait_dead(worker)
        assert worker.returncode == -9  # SIGKILL: the compile's CPU is released, not left running
    finally:
        service.timeout_s = 30.0
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.structured.failed
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # no leaked KV block
    # The engine and the fresh compile process keep serving.
    out = llm.generate(["Hi"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{3}")))
    assert len(out[0].outputs[0].text) == 3 and out[0].outputs[0].text.isdigit()


def test_other_streams_keep_their_pace_while_a_big_grammar_compiles_and_an_abort_stops_it(llm):
    """Step time of a plain stream without a compile, during a big one, and after aborting its request (which
    kills the compile process): the same run, the same request."""
    engine = llm.llm_engine
    engine.add_request("plain", "Hello", SamplingParams(max_tokens=400, ignore_eos=True))

    def mean_step(n: int = 20) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.mean(times)

    mean_step(5)  # prefill and first decodes
    before = mean_step()
    service = _service(llm)
    worker, compiles = service._worker.proc, service.num_compiles
    engine.add_request("big", "Hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        choice=BIG_CHOICE)))
    grammar = engine.scheduler.requests["big"].grammar
    during = mean_step()
    assert not grammar.ready and service.num_compiles == compiles + 1  # the window really overlapped the compile
    assert engine.abort_request("big")
    assert _wait_dead(worker) < 5.0 and worker.returncode == -9  # no waiter left: the compile was killed
    after = mean_step()
    engine.abort_request("plain")
    assert during / min(before, after) <= MAX_GAP_RATIO, (before, during, after)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_lru_cache_stays_under_its_cap_and_hits_still_work(llm):
    manager = llm.llm_engine.structured
    service = manager.service
    first = manager.compile(StructuredOutputsParams(regex="a[0-9]{1,2}"))
    cache = service.cache
    old_capacity = cache.capacity_bytes
    cache.capacity_bytes = int(3.5 * first.memory_size_bytes)  # room for about three grammars like these
    try:
        regexes = [f"{c}[0-9]{{1,2}}" for c in "bcdefghijk"]
        for r in regexes:
            manager.compile(StructuredOutputsParams(regex=r))
            assert cache.size_bytes <= cache.capacity_bytes
        assert 1 <= len(cache) <= 4
        assert cache.size_bytes == sum(nbytes for _, nbytes in cache._entries.values())
        compiles = service.num_compiles
        hit = manager.add_request(StructuredOutputsParams(regex=regexes[-1]), "hit")  # most recent: cached
        assert hit.ready and hit.error is None and service.num_compiles == compiles
        assert hit.matcher.accept_string("k42") and hit.matcher.is_terminated() is False
        miss = manager.add_request(StructuredOutputsParams(regex="a[0-9]{1,2}"), "miss")  # least recent: evicted
        miss.wait(120)
        assert miss.error is None and service.num_compiles == compiles + 1
        assert cache.size_bytes <= cache.capacity_bytes
    finally:
        cache.capacity_bytes = old_capacity


def test_cache_unit_lru_order_and_oversized_entries():
    cache = CompiledGrammarCache(100)
    keys = [GrammarKey("regex", str(i), True) for i in range(5)]
    for k in keys[:3]:
        assert cache.put(k, k.text, 30)
    assert cache.get(keys[0]) == "0"  # now the most recent: keys[1] is the least
    assert cache.put(keys[3], "3", 30)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) == "0" and cache.size_bytes == 90
    assert not cache.put(keys[4], "4", 101) and cache.get(keys[4]) is None  # alone over the cap: not kept
    assert cache.put(keys[0], "0'", 50)  # replaced: its old size is given back
    assert cache.size_bytes <= 100 and cache.get(keys[0]) == "0'"
    assert not CompiledGrammarCache(0).put(keys[0], "0", 1)  # cache_mb=0: nothing kept


@pytest.mark.parametrize("field, bad", [("structured_outputs_compile_timeout", 0),
                                        ("structured_outputs_compile_timeout", float("nan")),
                                        ("structured_outputs_compile_timeout", True),
                                        ("structured_outputs_cache_mb", -1), ("structured_outputs_cache_mb", 1.5)])
def test_bad_engine_options_are_value_errors(field, bad):
    with pytest.raises(ValueError, match=field):
        EngineConfig(device="cpu", **{field: bad})


def test_http_limits_and_timeout_are_400s(llm):
    """In-process app around the module's engine: the caps answer before any compile (the compile process's
    counter does not move), and a timed-out compile is a 400 naming structured_outputs."""
    from fastapi.testclient import TestClient

    from replayllm.entrypoints.openai.api_server import build_app

    engine = llm.llm_engine
    service = _service(llm)
    limits = RequestLimits(max_structured_choices=8000, max_structured_schema_bytes=1 << 20)
    tight = RequestLimits(max_structured_choices=3, max_structured_schema_bytes=64)
    long_schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}}
    with TestClient(build_app(engine=engine, limits=tight)) as c:
        compiles = service.num_compiles
        cases = [
            ({"structured_outputs": {"choice": ["a", "b", "c", "d"]}}, "structured_outputs",
             "too many entries in structured_outputs.choice: 4; this server allows at most 3 "
             "(--max-structured-choices)"),
            ({"structured_outputs": {"regex": "x" * 65}}, "structured_outputs",
             "structured_outputs.regex is 65 bytes; this server allows at most 64 (--max-structured-schema-bytes)"),
            ({"structured_outputs": {"json": long_schema}}, "structured_outputs", "structured_outputs.json is "),
            ({"structured_outputs": {"choice": ["x" * 40, "y" * 40]}}, "structured_outputs",
             "structured_outputs.choice is 80 bytes"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": long_schema}}},
             "response_format", "response_format.json_schema.schema is "),
        ]
        for fields, param, message in cases:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "limit_exceeded" and err["message"].startswith(message)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                                 "structured_outputs": {"choice": ["a", "b", "c", "d"]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
        assert service.num_compiles == compiles  # nothing reached the compiler
    service.timeout_s = 0.5
    try:
        with TestClient(build_app(engine=engine, limits=limits)) as c:
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                "structured_outputs": {"choice": BIG_CHOICE}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "structured_outputs" and "grammar compilation timed out" in err["message"]
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3,
                                                "structured_outputs": {"choice": ["yes", "no"]}})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    finally:
        service.timeout_s = 30.0
    assert not engine.has_unfinished_requests()


def test_core_rejection_reaches_only_its_stream_as_a_value_error():
    """The engine-core process's path (`replayllm serve`): CoreOutputs.rejected, encoded and decoded as the
    process boundary does, ends that request's stream with a ValueError (a 400), the other stream keeps going."""
    import asyncio

    from replayllm.engine.client_outputs import ClientOutputRouter
    from replayllm.engine.core_messages import ENCODER, OUTPUTS_DECODER, CoreOutputs
    from replayllm.engine.engine_stats import StatsSink
    from replayllm.engine.input_processor import InputProcessor
    from replayllm.engine.request_stream import RequestStream, Tracked

    class Stats(StatsSink):
        def __init__(self):
            self.finished = []

        def on_seq_finished(self, reason: str) -> None:
            self.finished.append(reason)

    class FakeClient:  # what ClientOutputRouter and RequestStream use of EngineCoreClient
        stats, snapshot = Stats(), None

        def abort(self, ids):
            pass

    inputs = InputProcessor(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512))
    message = "structured_outputs: grammar compilation timed out after 30 s (--structured-outputs-compile-timeout)"
    fake = FakeClient()
    router = ClientOutputRouter(inputs, fake)

    async def main():
        loop = asyncio.get_running_loop()
        streams = {rid: RequestStream(fake, [rid], loop) for rid in ("a", "b")}
        for rid, stream in streams.items():
            router.add(rid, inputs.prepare_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1)),
                       Tracked(stream, 0, 1, time.monotonic()))
        now = time.monotonic()
        msg = CoreOutputs(req_ids=["b"], token_ids=[7], num_cached_tokens=[0], finished=[("b", "length", None)],
                          step_started=now, step_ended=now, num_step_reqs=1, num_step_tokens=1,
                          rejected=[("a", message)])
        router.apply(OUTPUTS_DECODER.decode(ENCODER.encode(msg)))
        with pytest.raises(ValueError) as info:
            [out async for _, out in streams["a"].outputs()]
        outs = [out async for _, out in streams["b"].outputs()]
        return str(info.value), outs

    error, outs = asyncio.run(main())
    assert error == message and outs[-1].finished and outs[-1].outputs[0].token_ids == [7]
    assert "error" in fake.stats.finished  # counted as a failed sequence ("a"), not as finished
