"""Streamed chunks: msgspec-built SSE bytes equal the pydantic models' JSON; coalesced steps lose nothing."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.engine.async_engine import AsyncLLMEngine
from replayllm.engine.llm_engine import LLMEngine
from replayllm.entrypoints.http.limits import RequestLimits
from replayllm.entrypoints.openai.openai_protocol import CompletionRequest
from replayllm.entrypoints.openai.openai_responses import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    UsageInfo,
)
from replayllm.entrypoints.openai.serving_completions import CompletionServer
from replayllm.entrypoints.openai.stream_chunks import ChunkFrame, usage_dict

SETTINGS = dict(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=256)
TEXT = 'héllo "quoted" \\ back\nslash 智能 \u2028 end'


def _sse(model) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


def test_completion_chunk_bytes_equal_the_pydantic_model():
    frame = ChunkFrame("cmpl-abc", "text_completion", "replayllm/tiny-qwen3")
    logprobs = {"text_offset": [0, 5], "token_logprobs": [-15.1052827835083, None], "tokens": ["hé", "llo"],
                "top_logprobs": [{"hé": -15.1052827835083, " x": -0.25}, None], "token_ranks": [22701, None]}
    choice = {"index": 3, "text": TEXT, "logprobs": logprobs, "finish_reason": "stop", "stop_reason": 151645,
              "prompt_logprobs": None, "prompt_token_ids": [1, 2], "token_ids": [7, 8]}
    for usage in (None, usage_dict(4, 2)):
        got = frame.event({"choices": [choice], "usage": usage, "system_fingerprint": None})
        want = CompletionStreamResponse(id="cmpl-abc", created=frame.created, model="replayllm/tiny-qwen3",
                                        choices=[choice], usage=None if usage is None else UsageInfo.of(4, 2))
        assert got == _sse(want)
    final = frame.event({"choices": [], "usage": usage_dict(4, 2), "system_fingerprint": None})
    assert final == _sse(CompletionStreamResponse(id="cmpl-abc", created=frame.created, model="replayllm/tiny-qwen3",
                                                  choices=[], usage=UsageInfo.of(4, 2)))


def test_chat_chunk_bytes_equal_the_pydantic_model():
    frame = ChunkFrame("chatcmpl-1", "chat.completion.chunk", "m")
    lps = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "rank": 1,
                        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}]}
    for delta, logprobs, extra in (({"role": "assistant", "content": ""}, None, {}),
                                   ({"content": TEXT}, lps, {"prompt_token_ids": [5, 6]}),
                                   ({"content": ""}, None, {"usage": usage_dict(3, 1)})):
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None, "stop_reason": None,
                  "token_ids": None}
        rest = {"choices": [choice], "usage": extra.get("usage"), "prompt_token_ids": extra.get("prompt_token_ids")}
        want = ChatCompletionStreamResponse(id="chatcmpl-1", created=frame.created, model="m", choices=[choice],
                                            usage=extra.get("usage"), prompt_token_ids=extra.get("prompt_token_ids"))
        assert frame.event(rest) == _sse(want)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(**SETTINGS))


def _events(chunks: list[bytes]) -> list[dict]:
    text = b"".join(chunks).decode()
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


def test_steps_a_slow_reader_missed_arrive_as_one_chunk_equal_to_offline(engine):
    """A reader that falls behind gets everything new in one event (the stream keeps the newest output):
    the events still add up to the offline LLM's text, tokens and logprobs."""
    trace = engine.tokenizer.encode(" there lived a curious little robot who liked to read", add_special_tokens=False)
    prompt = [12522, 5193, 264, 882]
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()
    server = CompletionServer(async_engine, "m", RequestLimits().resolved(256))
    req = CompletionRequest(model="m", prompt=prompt, stream=True, logprobs=2, return_token_ids=True,
                            trace_decode_token_ids=trace, trace_replay_chunk_size=1,
                            stream_options={"include_usage": True})

    async def never_disconnects():
        await asyncio.Event().wait()

    async def run() -> tuple[list[bytes], list[bytes]]:
        body = await server.create(req, never_disconnects)
        chunks = body.__aiter__()
        first = [await chunks.__anext__()]
        deadline = time.monotonic() + 60  # the engine finishes the request while nobody reads
        while not any(out.finished for out in body.stream._pending.values()):
            assert time.monotonic() < deadline, "the request did not finish within 60 s"
            await asyncio.sleep(0.01)
        return first, [c async for c in chunks]

    try:
        first, rest = asyncio.run(run())
    finally:
        async_engine.stop()
    events = _events(first + rest)
    with_choices = [e["choices"][0] for e in events if e["choices"]]
    assert len(with_choices) == 2  # the first token, then all the others in one event
    assert len(with_choices[1]["token_ids"]) == len(trace) - len(with_choices[0]["token_ids"]) > 1
    ref = LLM(**SETTINGS).generate([{"prompt_token_ids": prompt}],
                                   SamplingParams(trace_decode_token_ids=trace, logprobs=2,
                                                  trace_replay_chunk_size=1))[0].outputs[0]
    assert [t for c in with_choices for t in c["token_ids"]] == ref.token_ids == trace
    assert "".join(c["text"] for c in with_choices) == ref.text
    streamed = [x for c in with_choices for x in c["logprobs"]["token_logprobs"]]
    # Like with like: one token a step on both sides, the request alone on an engine of the same settings (the
    # JSON floats round-trip exactly): bit for bit.
    assert streamed == [lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)]
    offsets = [x for c in with_choices for x in c["logprobs"]["text_offset"]]
    assert offsets == [len("".join(lp[t].decoded_token for t, lp in zip(ref.token_ids[:i], ref.logprobs)))
                       for i in range(len(ref.token_ids))]
    assert with_choices[-1]["finish_reason"] == "length" and with_choices[0]["finish_reason"] is None
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(trace)
