"""The Responses API (POST /v1/responses, GET /v1/responses/{id}) and vLLM's token-in/token-out
POST /inference/v1/generate, on an in-process app (ASGI, no socket): trace replay through both equals chat's /
the offline engine's, previous_response_id continues the conversation, the stored-response cap, clear 4xx."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest

from replayllm import SamplingParams
from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app
from replayllm.entrypoints.openai.serving_generate import routes_b64

LOGPROBS = ["message.output_text.logprobs"]
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def app():
    """server_reference_llm's settings (its results are the reference); at most 3 stored responses."""
    app = build_app(EngineConfig(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=512),
                    max_stored_responses=3)
    app.state.async_engine.start()
    yield app
    app.state.async_engine.stop()


@pytest.fixture(scope="module")
def tok(app):
    return app.state.async_engine.engine.tokenizer


@pytest.fixture(scope="module")
def trace(tok):
    return tok.encode(" there lived a curious little robot.", add_special_tokens=False)


def call(app, *requests: tuple) -> list[httpx.Response]:
    """Each (method, path, body) in order, on one client bound to the app."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return [await c.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(main())


def post(app, path: str, body: dict) -> httpx.Response:
    return call(app, ("POST", path, body))[0]


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE event."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines.get("event"), lines["data"]))
    return events


def test_replay_equals_chat(app, tok, trace):
    """The trace's text, and exactly chat's logprobs (same prompt, same trace, same engine)."""
    n = len(trace)
    chat = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}],
                                              "trace_decode_token_ids": trace, "max_completion_tokens": n,
                                              "logprobs": True, "top_logprobs": 2})
    resp = post(app, "/v1/responses", {"input": "Once upon a time", "trace_decode_token_ids": trace,
                                       "max_output_tokens": n, "include": LOGPROBS, "top_logprobs": 2})
    assert chat.status_code == resp.status_code == 200, resp.text
    body, choice = resp.json(), chat.json()["choices"][0]
    assert body["object"] == "response" and body["id"].startswith("resp_")
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    assert part["text"] == choice["message"]["content"] == tok.decode(trace)
    assert part["logprobs"] == choice["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in part["logprobs"]] == [2] * n
    usage = chat.json()["usage"]
    assert body["usage"]["input_tokens"] == usage["prompt_tokens"]
    assert body["usage"]["output_tokens"] == n == usage["completion_tokens"]
    assert body["usage"]["total_tokens"] == usage["prompt_tokens"] + n
    assert body["status"] == ("incomplete" if choice["finish_reason"] == "length" else "completed")


def test_stream_events(app, trace, tok):
    """OpenAI's event sequence, sequence numbers 0.., deltas (text and logprobs) adding up to the whole."""
    body = {"input": "Once upon a time", "trace_decode_token_ids": trace, "max_output_tokens": len(trace),
            "include": LOGPROBS, "stream": True, "metadata": {"run": "7"}}
    r = post(app, "/v1/responses", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    datas = [json.loads(d) for _, d in events]
    assert [name for name, _ in events] == [d["type"] for d in datas]
    kinds = [d["type"] for d in datas]
    assert kinds[:4] == EVENTS[:4] and kinds[-4:] == EVENTS[-4:]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [d["sequence_number"] for d in datas] == list(range(len(datas)))
    deltas = [d for d in datas if d["type"] == "response.output_text.delta"]
    done = datas[-4]
    assert "".join(d["delta"] for d in deltas) == done["text"] == tok.decode(trace)
    assert [e for d in deltas for e in d["logprobs"]] == done["logprobs"]
    final = datas[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == done["logprobs"]
    assert final["metadata"] == {"run": "7"} and datas[0]["response"]["status"] == "in_progress"
    stored = call(app, ("GET", f"/v1/responses/{final['id']}", None))[0]
    assert stored.status_code == 200 and stored.json() == final


def test_previous_response_id_continues(app, tok, trace):
    """The follow-up's prompt is the first exchange plus the new input (the instructions are not carried over,
    as OpenAI): its replayed logprobs equal chat's on that conversation, not on the new input alone."""
    first = post(app, "/v1/responses", {"input": "Hi there", "instructions": "Answer briefly.",
                                        "trace_decode_token_ids": trace[:3], "max_output_tokens": 3})
    assert first.status_code == 200, first.text
    answer = first.json()["output"][0]["content"][0]["text"]
    follow = post(app, "/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text",
                                                                                  "text": "And then?"}]}],
                                         "previous_response_id": first.json()["id"], "include": LOGPROBS,
                                         "trace_decode_token_ids": trace, "max_output_tokens": len(trace)})
    assert follow.status_code == 200, follow.text
    assert follow.json()["previous_response_id"] == first.json()["id"]
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": answer},
                    {"role": "user", "content": "And then?"}]
    chat = {"trace_decode_token_ids": trace, "max_completion_tokens": len(trace), "logprobs": True}
    full, alone = (post(app, "/v1/chat/completions", {**chat, "messages": m}).json()
                   for m in (conversation, conversation[2:]))
    got = follow.json()["output"][0]["content"][0]["logprobs"]
    assert got == full["choices"][0]["logprobs"]["content"] != alone["choices"][0]["logprobs"]["content"]
    assert follow.json()["usage"]["input_tokens"] == full["usage"]["prompt_tokens"]


def test_store_and_cap(app):
    """store false: not kept; past --max-stored-responses (3 here) the least recently used is dropped; unknown
    ids are 404s naming the parameter."""
    body = {"input": "Hello", "max_output_tokens": 1}
    kept = [post(app, "/v1/responses", body).json()["id"] for _ in range(3)]
    unstored = post(app, "/v1/responses", {**body, "store": False}).json()
    assert unstored["store"] is False
    assert call(app, ("GET", f"/v1/responses/{unstored['id']}", None))[0].status_code == 404
    assert call(app, ("GET", f"/v1/responses/{kept[0]}", None))[0].status_code == 200  # now most recent
    post(app, "/v1/responses", body)  # a fourth stored: drops kept[1], the least recently used
    statuses = [r.status_code for r in call(app, *[("GET", f"/v1/responses/{i}", None) for i in kept])]
    assert statuses == [200, 404, 200]
    missing = post(app, "/v1/responses", {**body, "previous_response_id": kept[1]})
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id" and kept[1] in missing.json()["error"]["message"]
    gone = call(app, ("GET", "/v1/responses/resp_unknown", None))[0]
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "function", "name": "f"}]}, "tools", "not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning", ""),
    ({"background": True}, "background", ""),
    ({"text": {"format": {"type": "json_object"}}}, "text.format.type", ""),
    ({"top_logprobs": 2}, "top_logprobs", "include"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0", ""),
    ({"max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input", "not supported"),
    ({"input": []}, "input", ""),
    ({"temperature": -1}, "temperature", ""),
    ({"model": "other"}, "model", "does not exist"),
    ({"user": "u" * 257}, "user", ""),  # accepted-and-ignored fields are capped as in chat
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", ""),
])
def test_responses_bad_requests(app, fields, param, words):
    r = post(app, "/v1/responses", {"input": "Hello", "max_output_tokens": 1, **fields})
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_openai_client(app, trace, tok):
    """openai's client.responses.create, plain and streamed, with the trace through extra_body."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed")

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
        extra = {"trace_decode_token_ids": trace}
        plain = await client.responses.create(model="replayllm/tiny-qwen3", input="Once upon a time",
                                              extra_body=extra)
        stream = await client.responses.create(input="Once upon a time", stream=True, extra_body=extra)
        events = [event async for event in stream]
        follow = await client.responses.create(input="More", previous_response_id=plain.id, max_output_tokens=2)
        await http.aclose()
        return plain, events, follow

    plain, events, follow = asyncio.run(main())
    assert plain.output_text.startswith(tok.decode(trace)) and plain.usage.output_tokens >= len(trace)
    assert [e.type for e in events][:4] == EVENTS[:4] and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    assert follow.previous_response_id == plain.id and follow.usage.input_tokens > plain.usage.input_tokens


def test_generate_equals_offline(app, server_reference_llm, tok, trace):
    """/inference/v1/generate with a trace: the trace's ids and exactly the offline engine's logprobs, whole and
    streamed; n choices; usage and [DONE] closing the stream."""
    prompt = tok.encode("Once upon a time")
    sp = {"max_tokens": len(trace), "logprobs": 2, "trace_decode_token_ids": trace}
    (ref,) = server_reference_llm.generate({"prompt_token_ids": prompt}, SamplingParams(**sp), use_tqdm=False)
    comp = ref.outputs[0]
    r = post(app, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sp, "request_id": "rollout-1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "rollout-1" and body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert choice["token_ids"] == trace == comp.token_ids and choice["routed_experts"] is None
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in trace]
    assert [e["logprob"] for e in entries] == [max(comp.logprobs[i][t].logprob, -9999.0) for i, t in enumerate(trace)]
    assert [e["rank"] for e in entries] == [comp.logprobs[i][t].rank for i, t in enumerate(trace)]
    for i, e in enumerate(entries):
        best = sorted((lp.rank, t, lp.logprob) for t, lp in comp.logprobs[i].items() if lp.rank <= 2)
        assert [(x["token"], x["logprob"]) for x in e["top_logprobs"]] == [(f"token_id:{t}", lp) for _, t, lp in best]
    assert choice["finish_reason"] == comp.finish_reason

    r = post(app, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sp, "stream": True,
                                             "stream_options": {"include_usage": True}})
    chunks = [d for _, d in sse_events(r.text)]
    assert chunks[-1] == "[DONE]"
    chunks = [json.loads(c) for c in chunks[:-1]]
    streamed = [c["choices"][0] for c in chunks[:-1]]
    assert [t for c in streamed for t in c["token_ids"]] == trace
    assert [e for c in streamed for e in c["logprobs"]["content"]] == entries
    assert [c["finish_reason"] for c in streamed][-1] == comp.finish_reason
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": len(prompt), "completion_tokens": len(trace), "total_tokens": len(prompt) + len(trace)}

    two = post(app, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "n": 2, "max_tokens": 3, "seed": 1, "prompt_logprobs": 1}}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1] and all(len(c["token_ids"]) == 3 for c in two["choices"])
    assert two["prompt_logprobs"][0] is None and len(two["prompt_logprobs"]) == len(prompt)


def test_routes_b64_round_trip():
    """routed_experts as vLLM sends them: np.load(io.BytesIO(base64.b64decode(s))) gives the array back."""
    routes = np.arange(24, dtype=np.int16).reshape(2, 3, 4) - 1
    back = np.load(io.BytesIO(base64.b64decode(routes_b64(routes))))
    assert back.dtype == np.int16 and np.array_equal(back, routes) and routes_b64(None) is None


def test_unknown_fields_of_responses_and_generate_bodies_are_ignored_and_named(app):
    """The server's unknown-field policy, as on chat (request_fields.py; 400s with --strict-request-fields)."""
    from replayllm.entrypoints.openai.request_fields import IGNORED_HEADER

    r = post(app, "/v1/responses", {"input": [{"role": "user", "content": "Hello", "x": 1}], "max_output_tokens": 1,
                                    "n": 2})
    assert r.status_code == 200 and r.headers[IGNORED_HEADER] == "n, input.0.x", r.text
    g = post(app, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1, "foo": 1}})
    assert g.status_code == 200 and g.headers[IGNORED_HEADER] == "sampling_params.foo", g.text


@pytest.mark.parametrize(("body", "param"), [
    ({"token_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": [1, 2], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
    ({"token_ids": [1, 2], "sampling_params": {"trace_decode_token_ids": [1], "n": 2}}, "sampling_params.n"),
    ({"token_ids": [1, 10**7], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1] * 600, "sampling_params": {}}, "token_ids"),
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, 2]}, "sampling_params"),
    ({"token_ids": [1, 2], "sampling_params": {}, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"token_ids": [1, 2], "sampling_params": {}, "priority": 1}, "priority"),
])
def test_generate_bad_requests(app, body, param):
    r = post(app, "/inference/v1/generate", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
