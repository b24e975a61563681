"""use_beam_search on /v1/completions and /v1/chat/completions (serving_beam_search.py): the choices are
LLM.beam_search's beams, best first, n per prompt; what beam search would not honour is a 400 naming the field.
In-process app on one engine."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from replayllm import LLM, BeamSearchParams
from replayllm.entrypoints.openai.api_server import build_app

PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=128)


def _client(llm) -> TestClient:
    return TestClient(build_app(engine=llm.llm_engine))


def test_choices_are_the_offline_beams(llm):
    body = {"prompt": PROMPTS, "use_beam_search": True, "n": 3, "max_tokens": 4, "ignore_eos": True,
            "length_penalty": 0.5, "logprobs": 2, "return_token_ids": True}
    with _client(llm) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == list(range(6))
    offline = llm.beam_search(PROMPTS,
                              BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=0.5))
    for i, out in enumerate(offline):
        for j, beam in enumerate(out.sequences):
            ch = choices[3 * i + j]
            generated = beam.tokens[len(ch["prompt_token_ids"]):]
            assert ch["prompt_token_ids"] == beam.tokens[: len(ch["prompt_token_ids"])]
            assert ch["token_ids"] == generated and ch["text"] == beam.text and ch["finish_reason"] == "length"
            lp = ch["logprobs"]
            assert lp["token_logprobs"] == pytest.approx([d[t].logprob for d, t in zip(beam.logprobs, generated)])
            assert all(len(top) <= 3 for top in lp["top_logprobs"])  # the chosen token and the 2 best
    assert r.json()["usage"]["completion_tokens"] == 6 * 4


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"), ({"top_p": 0.5}, "top_p"), ({"echo": True}, "echo"),
    ({"n": 11}, "n"), ({"max_tokens": 500}, "max_tokens"), ({"length_penalty": "1e400"}, "length_penalty"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": list(range(100, 228)), "max_tokens": None}, "prompt"),  # 128 ids: no position left to generate
])
def test_what_beam_search_would_not_honour_is_a_400(llm, extra, param):
    body = {"prompt": "Hello", "use_beam_search": True, "n": 2, "max_tokens": 3, **extra}
    with _client(llm) as c:  # 1e400: valid JSON that parses to infinity
        r = c.post("/v1/completions", content=json.dumps(body).replace('"1e400"', "1e400"),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_truncated_prompt_and_a_reasoning_parser(llm):
    """truncate_prompt_tokens keeps the prompt's last k tokens, as in any request; with --reasoning-parser (whose
    think tags are special tokens for this tokenizer or not) chat beam search answers 200."""
    with _client(llm) as c:
        r = c.post("/v1/completions", json={"prompt": "One two three four five six", "use_beam_search": True,
                                            "n": 2, "max_tokens": 2, "truncate_prompt_tokens": 3,
                                            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert all(len(ch["prompt_token_ids"]) == 3 for ch in r.json()["choices"])
    with TestClient(build_app(engine=llm.llm_engine, reasoning_parser="qwen3")) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "use_beam_search": True, "n": 2, "max_completion_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2


def test_chat_choices_are_the_offline_beams_of_the_rendered_messages(llm):
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"messages": messages, "use_beam_search": True, "n": 2, "max_completion_tokens": 3, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    with _client(llm) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        tools = c.post("/v1/chat/completions", json={**body, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]})
        assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"
    data = r.json()
    beams = llm.beam_search({"prompt_token_ids": data["prompt_token_ids"]},
                            BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0].sequences
    assert [ch["index"] for ch in data["choices"]] == [0, 1]
    for ch, beam in zip(data["choices"], beams):
        generated = beam.tokens[len(data["prompt_token_ids"]):]
        assert ch["token_ids"] == generated and ch["message"]["content"] == beam.text
        assert [e["logprob"] for e in ch["logprobs"]["content"]] == pytest.approx(
            [d[t].logprob for d, t in zip(beam.logprobs, generated)])
        assert all(len(e["top_logprobs"]) == 1 for e in ch["logprobs"]["content"])


def test_length_penalty_needs_beam_search(llm):
    with _client(llm) as c:
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "length_penalty": 2.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "length_penalty": 2.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty"
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "use_beam_search": False})
        assert ok.status_code == 200
