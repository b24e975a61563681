"""The Responses API with --reasoning-parser (vLLM's and OpenAI's shape): the output's <think> span is a
`reasoning` output item before the message, whose output_text is the answer only (before, the reasoning was
merged into output_text, its tags stripped); streamed as reasoning_text events then the message's, which
reassemble to the whole response; usage counts the reasoning tokens; the stored conversation keeps the answer.
An output forced with trace replay, on an in-process app."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app

THINK, ANSWER = "\nI reason here\n", "\n\nThe answer is 42."


@pytest.fixture(scope="module")
def app():
    app = build_app(EngineConfig(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=512,
                                 reasoning_parser="qwen3"))
    app.state.async_engine.start()
    yield app
    app.state.async_engine.stop()


@pytest.fixture(scope="module")
def trace(app):
    tok = app.state.async_engine.engine.tokenizer
    return tok.encode(f"<think>{THINK}</think>{ANSWER}", add_special_tokens=False)


def _post(app, body: dict) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/responses", json=body)
    return asyncio.run(main())


def test_reasoning_is_its_own_output_item(app, trace):
    r = _post(app, {"input": "Q?", "trace_decode_token_ids": trace, "include": ["message.output_text.logprobs"]})
    assert r.status_code == 200, r.text
    body = r.json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THINK}] and reasoning["summary"] == []
    assert reasoning["status"] == "completed"
    assert message["type"] == "message" and message["content"][0]["text"] == ANSWER
    assert len(message["content"][0]["logprobs"]) == len(trace)  # every token's, as before
    end = trace.index(app.state.async_engine.engine.tokenizer.convert_tokens_to_ids("</think>"))
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == end + 1
    follow = _post(app, {"input": "and?", "previous_response_id": body["id"], "max_output_tokens": 2})
    assert follow.status_code == 200, follow.text


def test_streamed_events_reassemble_to_the_whole_response(app, trace):
    whole = _post(app, {"input": "Q?", "trace_decode_token_ids": trace}).json()
    r = _post(app, {"input": "Q?", "trace_decode_token_ids": trace, "stream": True})
    assert r.status_code == 200, r.text
    events = [json.loads(block.split("\ndata: ", 1)[1]) for block in r.text.split("\n\n") if block]
    kinds = [e["type"] for e in events]
    deltas = [i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta"]
    texts = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert deltas and texts and max(deltas) < kinds.index("response.reasoning_text.done") < min(texts)
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "".join(events[i]["delta"] for i in deltas) == THINK
    assert "".join(events[i]["delta"] for i in texts) == ANSWER
    assert all(events[i]["output_index"] == 0 for i in deltas) and all(events[i]["output_index"] == 1 for i in texts)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]["output"]
    assert [{k: v for k, v in item.items() if k != "id"} for item in final] == \
        [{k: v for k, v in item.items() if k != "id"} for item in whole["output"]]


def test_without_a_reasoning_span_one_message_as_before(app):
    """qwen3: an output that does not open with <think> is all content: no reasoning item."""
    tok = app.state.async_engine.engine.tokenizer
    plain = tok.encode(" plain words", add_special_tokens=False)
    body = _post(app, {"input": "Q?", "trace_decode_token_ids": plain}).json()
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["output"][0]["content"][0]["text"] == " plain words"
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
