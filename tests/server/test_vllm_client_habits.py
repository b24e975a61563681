"""What clients written for vLLM / the OpenAI SDK send and vLLM accepts: an assistant message sent back with its
reasoning_content, both max_tokens and max_completion_tokens (the latter wins), length_penalty 1.0 without beam
search, chat `echo`, a Responses output message sent back with the SDK's `phase`, and a clear 400 for a form post;
vLLM's 400 for a max_tokens past the context (and where it does not apply). In-process apps on one engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from replayllm import LLM
from replayllm.entrypoints.openai.api_server import build_app

USER = [{"role": "user", "content": "hi"}]
CHAT = {"messages": USER, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
# A template that renders reasoning_content when a message has one (as Qwen3's does).
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
            "</think>{% endif %} {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def c(llm):
    with TestClient(build_app(engine=llm.llm_engine, chat_template=TEMPLATE)) as client:
        yield client


def test_an_assistant_message_sent_back_with_its_reasoning_reaches_the_template(c):
    first = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert "reasoning_content" in first  # what the SDK sends back as it is
    history = [*USER, {**first, "content": "ok"}, {"role": "user", "content": "and?"}]
    plain = c.post("/v1/chat/completions", json={**CHAT, "messages": history})
    assert plain.status_code == 200, plain.text
    ids = {}
    for field in ("reasoning_content", "reasoning"):
        msgs = [*USER, {"role": "assistant", "content": "ok", field: "because"}, {"role": "user", "content": "and?"}]
        r = c.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
        assert r.status_code == 200, r.text
        ids[field] = r.json()["prompt_token_ids"]
    assert ids["reasoning_content"] == ids["reasoning"] != plain.json()["prompt_token_ids"]


def test_max_completion_tokens_wins_over_max_tokens(c):
    r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "max_completion_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    bad = c.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_completion_tokens", bad.text


def test_length_penalty_at_its_default_is_accepted_without_beam_search(c):
    assert c.post("/v1/chat/completions", json={**CHAT, "length_penalty": 1.0}).status_code == 200
    r = c.post("/v1/chat/completions", json={**CHAT, "length_penalty": 2.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"


def test_chat_echo_puts_the_continued_assistant_message_first(c):
    msgs = [*USER, {"role": "assistant", "content": "Hel"}]
    body = {**CHAT, "messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    plain = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = c.post("/v1/chat/completions", json={**body, "echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == "Hel" + plain
    # After a user message nothing is echoed (vLLM echoes only a message of the answer's role).
    assert (c.post("/v1/chat/completions", json={**CHAT, "echo": True}).json()["choices"][0]["message"]["content"]
            == c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"])
    r = c.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Hel"}
    assert "".join(d.get("content", "") for d in deltas) == echoed


def test_a_responses_output_message_sent_back_by_the_sdk_is_accepted(c):
    first = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3}).json()
    item = {**first["output"][0], "phase": None}  # the OpenAI SDK's model_dump() of an output message
    r = c.post("/v1/responses", json={"input": [{"role": "user", "content": "hi"}, item], "max_output_tokens": 3})
    assert r.status_code == 200, r.text
    empty = c.post("/v1/responses", json={"input": []})
    assert empty.status_code == 400 and "non-empty list" in empty.json()["error"]["message"]


def test_a_form_post_is_told_to_send_json(c):
    r = c.post("/v1/completions", content=b'{"prompt": "hi"}',
               headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"], r.text


def test_the_clients_request_id_names_the_response(c):
    r = c.post("/v1/chat/completions", json={**CHAT, "request_id": "abc-1"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-abc-1", r.text
    r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "request_id": "abc-1"},
               headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-7", r.text  # the header wins, as in vLLM
    # One id twice at once: the engine's ids stay distinct (a random suffix there), both answered.
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda _: c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                                     "request_id": "same"}), range(2)))
    assert [r.json()["id"] for r in rs] == ["cmpl-same"] * 2
    bad = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "request_id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id", bad.text


def test_cache_salt_keeps_the_prefix_cache_apart_over_http(c, llm):
    def hits() -> int:  # counted when a request is scheduled, before its answer exists
        return llm.llm_engine.block_manager.num_prefix_hits

    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    for path, body in (("/v1/completions", {"prompt": long, "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long}], "max_tokens": 1})):
        salt = path.split("/")[-1]  # a salt no earlier request used
        assert c.post(path, json={**body, "cache_salt": salt}).status_code == 200
        before = hits()
        assert c.post(path, json={**body, "cache_salt": salt + "-other"}).status_code == 200
        assert hits() == before  # another salt: nothing from the cache
        assert c.post(path, json={**body, "cache_salt": salt}).status_code == 200
        assert hits() > before  # the same salt: its blocks again
    bad = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt", bad.text


def test_max_tokens_must_fit_beside_the_prompt_as_vllms_server_says(c):
    """vLLM's server: prompt + max_tokens > max_model_len is a 400 naming both numbers (its wording, which clients
    match); exactly the room left is fine. Not for truncate_prompt_tokens -1 nor the Responses API's
    max_output_tokens (both cut to the context, as vLLM's), nor (test_server_limits) a trace."""
    ids = [(7 * i) % 200 + 20 for i in range(250)]  # max_model_len 256: room for 6
    body = {"prompt": ids, "temperature": 0, "ignore_eos": True}
    fits = c.post("/v1/completions", json={**body, "max_tokens": 6})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 6, fits.text
    over = c.post("/v1/completions", json={**body, "max_tokens": 7})
    assert over.status_code == 400, over.text
    assert over.json()["error"] == {
        "message": "'max_tokens' or 'max_completion_tokens' is too large: 7. This model's maximum context length is "
                   "256 tokens and your request has 250 input tokens (7 > 256 - 250)",
        "type": "invalid_request_error", "param": "max_tokens", "code": None}
    cut = c.post("/v1/completions", json={**body, "prompt": ids[:10], "max_tokens": 250, "truncate_prompt_tokens": 8})
    assert cut.status_code == 400 and "(250 > 256 - 8)" in cut.json()["error"]["message"], cut.text  # k counts
    most = c.post("/v1/completions", json={**body, "max_tokens": 7, "truncate_prompt_tokens": -1})
    assert most.status_code == 200 and most.json()["choices"][0]["finish_reason"] == "length", most.text
    chat = c.post("/v1/chat/completions", json={**CHAT, "max_completion_tokens": 300})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text
    assert "maximum context length is 256 tokens" in chat.json()["error"]["message"]
    long = c.post("/v1/completions", json={**body, "prompt": ids * 2, "max_tokens": 1})
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text
    assert long.json()["error"]["message"].startswith("This model's maximum context length is 256 tokens. However, "
                                                      "your request has 500 input tokens")
    responses = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 300})
    assert responses.status_code == 200, responses.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_counts_only_with_include_usage(c, path):
    """vLLM: usage on every chunk needs include_usage and continuous_usage_stats; the latter alone adds none."""
    body = ({"prompt": "hi", "max_tokens": 4} if path == "/v1/completions" else {**CHAT, "max_tokens": 4})

    def chunks(options):
        r = c.post(path, json={**body, "stream": True, "stream_options": options, "ignore_eos": True})
        assert r.status_code == 200, r.text
        events = [e[6:] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    alone = chunks({"continuous_usage_stats": True})
    assert alone and all(e.get("usage") is None for e in alone)
    both = chunks({"continuous_usage_stats": True, "include_usage": True})
    assert all(e.get("usage") is not None for e in both)
    assert both[-1]["choices"] == [] and both[-1]["usage"]["completion_tokens"] == 4
