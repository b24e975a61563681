"""Direct stream writes (RequestStream.sink): the same SSE bytes as the reader's queued path, no reader wakeups."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from replayllm.config import EngineConfig
from replayllm.engine.llm_engine import LLMEngine
from replayllm.engine.request_stream import RequestStream
from replayllm.entrypoints.http.http_protocol import DirectChunkWriter
from replayllm.entrypoints.openai.openai_protocol import ChatCompletionRequest, CompletionRequest
from replayllm.entrypoints.openai.serving_chat import FIELDS as CHAT_FIELDS
from replayllm.entrypoints.openai.serving_chat import _Renderer as ChatRenderer
from replayllm.entrypoints.openai.serving_completions import FIELDS, PreparedPrompt
from replayllm.entrypoints.openai.serving_completions import _Renderer as CompletionRenderer
from replayllm.entrypoints.openai.sse_response import direct_sink
from replayllm.entrypoints.openai.streaming import guard_sse
from replayllm.sampling_params import SamplingParams

SETTINGS = dict(dtype="float32", device="cpu", max_model_len=256)
PROMPTS = [[12522, 5193, 264, 882], [785, 6722, 315]]  # "Once upon a time", "The capital of"


class _Flow:
    def __init__(self):
        self.write_paused = False
        self.resumed = asyncio.Event()

    async def drain(self) -> None:
        await self.resumed.wait()


class _Transport:
    def __init__(self):
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data


class _Cycle:
    """What DirectChunkWriter reads of uvicorn's RequestResponseCycle."""

    def __init__(self):
        self.transport, self.flow = _Transport(), _Flow()
        self.disconnected = self.response_complete = False


class _Engine:
    def __init__(self):
        self.aborted = []

    def abort(self, ids):
        self.aborted += ids


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(**SETTINGS))


def _steps(engine, prompts, params) -> list[list[tuple[int, object]]]:
    """Each engine step's (prompt index, cumulative RequestOutput) pairs, as the router delivers them."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r-{i}", {"prompt_token_ids": p}, params)
    steps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        if outs:
            steps.append([(int(o.request_id.rsplit("-", 1)[1]), o) for o in outs])
    return steps


def _dechunk(raw: bytes) -> bytes:
    """The body of HTTP/1.1 chunked framing (`size\\r\\ndata\\r\\n`...)."""
    body, pos = bytearray(), 0
    while pos < len(raw):
        end = raw.index(b"\r\n", pos)
        size = int(raw[pos:end], 16)
        body += raw[end + 2:end + 2 + size]
        assert raw[end + 2 + size:end + 4 + size] == b"\r\n"
        pos = end + 4 + size
    return bytes(body)


async def _serve(renderer, steps, n_prompts: int, direct: bool, fields, pause_at: int | None = None,
                 before_steps: list[bytes] | None = None):
    """Feed `steps` through a RequestStream into the renderer's SSE body, written by a DirectChunkWriter on a
    fake transport: with `direct`, unfinished outputs go through the sink. Returns (body bytes, chunks the
    reader wrote, times the sink declined). `pause_at`: the transport is over its high-water mark from that
    step on, until every step was delivered. `before_steps` gets what the transport held before each step."""
    loop = asyncio.get_running_loop()
    stream = RequestStream(_Engine(), [f"r-{i}" for i in range(n_prompts)], loop)

    async def never_disconnects():
        await asyncio.Event().wait()

    body = guard_sse(renderer.chunks(stream), stream, never_disconnects, fields, renderer.render)
    cycle = _Cycle()
    writer = DirectChunkWriter(cycle)
    declined = [0]
    if direct:
        sink = direct_sink(body, writer)

        def counting_sink(index, out):
            ok = sink(index, out)
            declined[0] += not ok
            return ok

        stream.sink = counting_sink
    reader_writes = [0]

    async def read():
        async for chunk in body:
            reader_writes[0] += 1
            await writer(chunk)

    task = asyncio.create_task(read())
    for k, step in enumerate(steps):
        if k == pause_at:
            cycle.flow.write_paused = True
        for _ in range(1000):  # until the reader is parked again (it wrote everything before)
            if stream._waiter is not None or task.done() or cycle.flow.write_paused:
                break
            await asyncio.sleep(0)
        if before_steps is not None:
            before_steps.append(bytes(cycle.transport.data))
        for index, out in step:
            stream.deliver(index, out)
    cycle.flow.write_paused = False
    cycle.flow.resumed.set()
    await asyncio.wait_for(task, 60)
    return _dechunk(bytes(cycle.transport.data)), reader_writes[0], declined[0]


def _same(a: bytes, b: bytes) -> None:
    created = re.compile(rb'"created":\d+')  # one stamp per stream, from its own clock second
    assert created.sub(b"", a) == created.sub(b"", b)


@pytest.fixture(scope="module")
def completion_case(engine):
    """A renderer factory and the engine steps of: 2 prompts, n=2 sampled, logprobs, echo (with prompt
    logprobs), token ids, a stop string, continuous usage and the usage chunk."""
    req = CompletionRequest(model="m", prompt=PROMPTS, stream=True, n=2, temperature=0.8, seed=7, max_tokens=12,
                            logprobs=2, echo=True, return_token_ids=True, stop=[" the"],
                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=2,
                            stop=[" the"])
    prepared = [PreparedPrompt(engine.tokenizer.decode(p), p, [engine.decode_token(t) or "" for t in p])
                for p in PROMPTS]
    steps = _steps(engine, PROMPTS, params)
    return lambda: CompletionRenderer(req, "cmpl-1", "m", prepared, 2), steps


def test_direct_completion_stream_bytes_equal_the_queued_path(completion_case):
    make, steps = completion_case
    assert len(steps) > 4
    queued, queued_writes, _ = asyncio.run(_serve(make(), steps, 2, False, FIELDS))
    direct, direct_writes, declined = asyncio.run(_serve(make(), steps, 2, True, FIELDS))
    _same(direct, queued)
    assert queued.endswith(b"data: [DONE]\n\n") and b'"usage":{"prompt_tokens":' in queued
    # The reader wrote each step's chunk before; now only the finishes, the usage chunk and [DONE].
    assert queued_writes >= len(steps) and direct_writes <= 2 + 2 and declined == 0


def test_direct_chat_stream_bytes_equal_the_queued_path(engine):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True, n=2,
                                temperature=0.9, seed=3, max_tokens=10, logprobs=True, top_logprobs=2,
                                return_token_ids=True, stream_options={"include_usage": True})
    steps = _steps(engine, PROMPTS[:1], SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=10, logprobs=2))
    queued, _, _ = asyncio.run(_serve(ChatRenderer(req, "chatcmpl-1", "m", 2), steps, 1, False, CHAT_FIELDS))
    direct, direct_writes, _ = asyncio.run(_serve(ChatRenderer(req, "chatcmpl-1", "m", 2), steps, 1, True,
                                                  CHAT_FIELDS))
    _same(direct, queued)
    assert b'"role":"assistant"' in direct and direct.endswith(b"data: [DONE]\n\n")
    assert direct_writes <= 4  # the role chunk, the finish, the usage chunk, [DONE]


def test_chat_role_chunk_goes_with_the_first_output(engine):
    """vLLM sends the role chunk with the first output, not at the request's acceptance: a client that times its
    first chunk (vLLM's `bench serve --backend openai-chat`) then measures the time to the first token. On both
    paths nothing is written before the first step; its write is the role chunk, then the first token's."""
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=6,
                                temperature=0)
    steps = _steps(engine, PROMPTS[:1], SamplingParams(max_tokens=6, temperature=0))
    for direct in (False, True):
        before: list[bytes] = []
        raw, _, _ = asyncio.run(_serve(ChatRenderer(req, "chatcmpl-1", "m", 1), steps, 1, direct, CHAT_FIELDS,
                                       before_steps=before))
        assert before[0] == b"" and len(before) == len(steps) > 2
        first = [json.loads(e[6:]) for e in _dechunk(before[1]).split(b"\n\n") if e.startswith(b"data: {")]
        assert [c["choices"][0]["delta"] for c in first][:1] == [{"role": "assistant", "content": ""}]
        assert len(first) == 2 and first[1]["choices"][0]["delta"]["content"]  # the first token with it
        assert raw.count(b'"role":"assistant"') == 1


def test_back_pressure_falls_back_to_the_queued_path_in_order(completion_case):
    """A transport over its high-water mark: the sink declines, outputs queue (the newest replaces the older:
    nothing is lost, the next chunk carries every token since), and the reader writes them after the drain."""
    make, steps = completion_case
    queued, _, _ = asyncio.run(_serve(make(), steps, 2, False, FIELDS))
    direct, _, declined = asyncio.run(_serve(make(), steps, 2, True, FIELDS, pause_at=2))
    assert declined >= 1
    events = [e for e in direct.split(b"\n\n") if e]
    assert len(events) < len([e for e in queued.split(b"\n\n") if e])  # the paused steps coalesced
    def text_of(raw: bytes) -> dict:
        texts: dict[int, str] = {}
        for e in raw.split(b"\n\n"):
            if e.startswith(b"data: {"):
                for c in json.loads(e[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        return texts

    assert text_of(direct) == text_of(queued) and len(text_of(direct)) == 4


def test_sink_is_used_only_while_the_reader_is_parked_with_nothing_pending(completion_case):
    make, steps = completion_case
    calls = []

    async def main():
        stream = RequestStream(_Engine(), ["r-0", "r-1"], asyncio.get_running_loop())
        stream.sink = lambda i, out: calls.append(i) or True
        first = [(i, o) for step in steps for i, o in step if not o.finished][:2]
        stream.deliver(*first[0])  # the reader is not parked yet: queued
        assert calls == [] and stream._pending
        outputs = stream.outputs()
        assert (await outputs.__anext__())[0] == first[0][0]
        waiting = asyncio.ensure_future(outputs.__anext__())
        await asyncio.sleep(0)  # parked now
        stream.deliver(*first[1])
        assert calls == [first[1][0]] and not waiting.done() and not stream._pending
        final = next((i, o) for step in steps for i, o in step if o.finished)
        stream.deliver(*final)  # a finished output always wakes the reader
        assert await waiting == final and len(calls) == 1
        stream.fail(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            await outputs.__anext__()

    asyncio.run(main())


def test_a_renderer_error_in_the_sink_ends_the_stream_with_an_error_event(completion_case):
    """A chunk the sink cannot render ends that stream only (an SSE error event, then [DONE]); the deliverer
    (the router, serving every stream) never sees the exception."""
    make, steps = completion_case
    renderer = make()
    render, calls = renderer.render, [0]

    def failing_after_one(index, out):  # the first chunk renders; every later one raises
        calls[0] += 1
        if calls[0] > 1:
            raise ValueError("cannot render")
        return render(index, out)

    renderer.render = failing_after_one
    raw, _, declined = asyncio.run(_serve(renderer, steps, 2, True, FIELDS))
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert "error" in events[-1] and "cannot render" in events[-1]["error"]["message"]
    assert raw.endswith(b"data: [DONE]\n\n") and declined == 0
