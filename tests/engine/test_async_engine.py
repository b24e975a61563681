"""AsyncLLMEngine in-process: batching across callers, all-or-nothing adds, aborts, step failures, shutdown."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from replayllm import SamplingParams
from replayllm.config import EngineConfig
from replayllm.engine.async_engine import AsyncLLMEngine
from replayllm.engine.engine_stats import StatsSink
from replayllm.engine.llm_engine import LLMEngine
from replayllm.engine.request_stream import EngineDeadError, EngineStepError, RequestAborted


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=256))


@pytest.fixture
def async_engine(engine):
    ae = AsyncLLMEngine(engine)
    ae.start()
    yield ae
    ae.stop()


def ids(engine, text: str) -> dict:
    return {"prompt_token_ids": engine.tokenizer.encode(text)}


async def final(stream) -> list[list[int]]:
    last = None
    async for _, out in stream.outputs():
        last = out
    return [c.token_ids for c in last.outputs]


def test_concurrent_callers_share_steps_and_match_alone(engine, async_engine):
    """Requests from concurrent callers join the same steps, with the results they get alone: traces,
    greedy, and seeded n=2 sampling, arriving at random moments while others run."""
    tok = engine.tokenizer
    specs = []
    for i in range(12):
        prompt = ids(engine, f"Caller {i} says once upon a time")
        if i % 3 == 0:
            p = SamplingParams(trace_decode_token_ids=tok.encode(f" replay {i} here", add_special_tokens=False),
                               logprobs=1)
        elif i % 3 == 1:
            p = SamplingParams(max_tokens=5, temperature=0)
        else:
            p = SamplingParams(n=2, seed=i, temperature=1.0, max_tokens=4)
        specs.append((prompt, p))

    async def one(name, prompt, p, delay=0.0):
        await asyncio.sleep(delay)
        return await final(await async_engine.add_requests(name, [prompt], [p]))

    async def main():
        alone = [await one(f"alone{i}", pr, p) for i, (pr, p) in enumerate(specs)]
        steps_before = engine.num_steps
        rng = random.Random(0)
        together = await asyncio.gather(*(one(f"together{i}", pr, p, rng.random() * 0.2)
                                          for i, (pr, p) in enumerate(specs)))
        return alone, together, engine.num_steps - steps_before

    alone, together, steps = asyncio.run(main())
    assert together == alone
    for (_, p), got in zip(specs, together):
        if p.trace_decode_token_ids is not None:
            assert got == [p.trace_decode_token_ids]
    assert engine.max_running_in_step > 1
    assert steps < sum(len(r[0]) for r in alone)  # fewer steps than one request at a time would take


def test_bad_prompt_queues_nothing(engine, async_engine):
    good = ids(engine, "fine")

    async def main():
        with pytest.raises(ValueError, match="vocabulary"):
            await async_engine.add_requests("mixed", [good, good],
                                            [SamplingParams(), SamplingParams(trace_decode_token_ids=[10**7])])
        with pytest.raises(ValueError, match="max_model_len"):
            await async_engine.add_requests("long", [{"prompt_token_ids": [15] * 300}], [SamplingParams()])
        return await async_engine.run(lambda e: (e.has_unfinished_requests(), len(e.output_processor.parents)))

    assert asyncio.run(main()) == (False, 0)


def test_leaving_the_stream_aborts_and_frees_blocks(engine, async_engine):
    async def main():
        stream = await async_engine.add_requests(
            "long", [ids(engine, "Once upon a time")], [SamplingParams(max_tokens=200, ignore_eos=True)])
        async for _, out in stream.outputs():
            if len(out.outputs[0].token_ids) >= 3:
                break  # closing the iterator aborts the request
        for _ in range(100):
            free, total, busy = await async_engine.run(
                lambda e: (e.block_manager.num_free_blocks, e.block_manager.num_blocks, e.has_unfinished_requests()))
            if free == total and not busy:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_abort_delivers_to_a_waiting_reader(engine, async_engine):
    async def main():
        stream = await async_engine.add_requests(
            "victim", [ids(engine, "Once upon a time")], [SamplingParams(max_tokens=200, ignore_eos=True)])
        async_engine.abort(stream.request_ids)
        with pytest.raises(RequestAborted):
            async for _ in stream.outputs():
                pass

    asyncio.run(main())


class _CountingStats(StatsSink):
    def __init__(self):
        self.errors = 0
        self.finished: list[str] = []

    def on_step_error(self):
        self.errors += 1

    def on_seq_finished(self, reason):
        self.finished.append(reason)


def _fail_nth_execute(engine, monkeypatch, n: int) -> None:
    """The runner's n-th step raises (a simulated device failure); every other step runs normally."""
    real_execute = engine.runner.execute
    calls = {"n": 0}

    def flaky_execute(sched):
        calls["n"] += 1
        if calls["n"] == n:
            raise RuntimeError("simulated device failure")
        return real_execute(sched)

    monkeypatch.setattr(engine.runner, "execute", flaky_execute)


def test_failing_step_fails_its_requests_and_the_loop_goes_on(engine, monkeypatch):
    stats = _CountingStats()
    ae = AsyncLLMEngine(engine, stats=stats)
    _fail_nth_execute(engine, monkeypatch, 2)
    ae.start()
    try:
        async def main():
            doomed = await ae.add_requests("doomed", [ids(engine, "Once upon a time")],
                                           [SamplingParams(max_tokens=20, ignore_eos=True)])
            with pytest.raises(EngineStepError, match="simulated device failure"):
                await final(doomed)
            return await final(await ae.add_requests("after", [ids(engine, "Once upon a time")],
                                                      [SamplingParams(max_tokens=3, temperature=0)]))

        tokens = asyncio.run(main())
    finally:
        ae.stop()
    assert len(tokens[0]) == 3
    assert stats.errors == 1 and stats.finished.count("error") == 1


def test_stop_fails_requests_in_flight(engine):
    ae = AsyncLLMEngine(engine)
    ae.start()

    async def main():
        stream = await ae.add_requests("inflight", [ids(engine, "Once upon a time")],
                                       [SamplingParams(max_tokens=200, ignore_eos=True)])
        await asyncio.to_thread(ae.stop)
        with pytest.raises(EngineDeadError):
            await final(stream)
        with pytest.raises(EngineDeadError):
            await ae.add_requests("late", [ids(engine, "x")], [SamplingParams()])

    asyncio.run(main())
    assert not ae.is_running


def test_step_failure_mid_stream_becomes_an_sse_error_event(engine, monkeypatch):
    """The status line is already sent when a step fails mid-stream: the client gets an error event, then
    [DONE]; the server answers the next request normally (in-process app, no lifespan: started by hand)."""
    import httpx

    from replayllm.entrypoints.openai.api_server import build_app

    app = build_app(engine=engine)
    ae = app.state.async_engine
    _fail_nth_execute(engine, monkeypatch, 3)
    ae.start()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"prompt": "Once upon a time", "max_tokens": 10, "ignore_eos": True, "stream": True}
            events = []
            async with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
            after = await c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2})
            metrics = (await c.get("/metrics")).text
        return events, after, metrics

    try:
        events, after, metrics = asyncio.run(main())
    finally:
        ae.stop()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_step_failed"
    assert "simulated device failure" not in error["message"]  # a 500 never carries the exception's text
    assert after.status_code == 200 and len(after.json()["choices"][0]["text"]) > 0
    assert "replayllm:engine_step_errors_total 1.0" in metrics


def test_sse_body_close_aborts_even_when_never_iterated():
    """A client gone before the first chunk: the body generator never starts, so only close() can abort."""
    from replayllm.entrypoints.openai.streaming import SSEBody

    class FakeStream:
        aborted = 0

        def abort(self):
            self.aborted += 1

    async def chunks():
        yield "data: x\n\n"

    stream = FakeStream()
    body = SSEBody(chunks(), stream)
    body.close()
    assert stream.aborted == 1
