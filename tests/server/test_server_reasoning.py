"""thinking_token_budget and repetition_detection over HTTP, on a real `replayllm serve` subprocess (the engine
core in its own process: the params travel pickled). The fixtures are test_server.py's."""

# ruff: noqa: F811 -- the fixtures are imported from test_server.py (one definition), so test arguments "redefine" them

from __future__ import annotations

import json

import httpx
from test_server import MODEL, PROMPT, client, llm, post, server, server_idle_after_each_test  # noqa: F401

from replayllm import SamplingParams

THINK, END_THINK = 151667, 151668
OPEN_THINK = {str(THINK): 100}  # logit_bias: the model opens <think> at once and stays there


def _choice(server, path: str, body: dict) -> dict:
    r = post(server, path, {"model": MODEL, "temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_thinking_budget_completions_equals_offline(server, llm):
    choice = _choice(server, "/completions", {"prompt": PROMPT, "max_tokens": 8, "logit_bias": OPEN_THINK,
                                              "thinking_token_budget": 2})
    assert choice["token_ids"] == [THINK, THINK, THINK, END_THINK, THINK, THINK, THINK, END_THINK]
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, logit_bias={THINK: 100},
                                                thinking_token_budget=2), use_tqdm=False)[0].outputs[0]
    assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text


def test_thinking_budget_chat(server, llm):
    messages = [{"role": "user", "content": "Think briefly."}]
    choice = _choice(server, "/chat/completions", {"messages": messages, "max_tokens": 6, "logit_bias": OPEN_THINK,
                                                   "thinking_token_budget": 0})
    assert choice["token_ids"] == [THINK, END_THINK] * 3
    assert choice["finish_reason"] == "length"


def test_repetition_detection_completions_and_chat(server):
    body = {"max_tokens": 20, "logit_bias": {"1052": 100},
            "repetition_detection": {"max_pattern_size": 2, "min_pattern_size": 1, "min_count": 4}}
    choice = _choice(server, "/completions", {"prompt": PROMPT, **body})
    assert choice["token_ids"] == [1052] * 4
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", "repetition_detected")
    chat = _choice(server, "/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], **body})
    assert chat["token_ids"] == [1052] * 4
    assert (chat["finish_reason"], chat["stop_reason"]) == ("stop", "repetition_detected")


def test_repetition_detection_streamed(server):
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 20, "stream": True,
            "logit_bias": {"1052": 100}, "repetition_detection": {"max_pattern_size": 1, "min_count": 3}}
    finals = []
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=server.headers,
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                finals += [c for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    assert [(c["finish_reason"], c["stop_reason"]) for c in finals] == [("stop", "repetition_detected")]


def _error(server, path: str, body: dict) -> dict:
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_bad_values_are_400s(server):
    err = _error(server, "/completions", {"prompt": PROMPT, "thinking_token_budget": -3})
    assert err["param"] == "thinking_token_budget"
    err = _error(server, "/completions", {"prompt": PROMPT, "repetition_detection": {"max_pattern_size": 2}})
    assert err["param"] == "repetition_detection" and "min_count must be >= 2" in err["message"]
    # An unknown key inside it is the server's unknown-field policy (ignored and named; 400 when strict)
    r = httpx.post(server.base_url + "/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                          "repetition_detection": {"window": 2}},
                   headers=server.headers, timeout=60)
    assert r.status_code == 200 and r.headers["x-replayllm-ignored-fields"] == "repetition_detection.window"


def test_with_a_trace_is_a_400_naming_both(server):
    for field, value in (("thinking_token_budget", 4),
                         ("repetition_detection", {"max_pattern_size": 2, "min_count": 2})):
        for path, prompt in (("/completions", {"prompt": PROMPT}),
                             ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            err = _error(server, path, {**prompt, "trace_decode_token_ids": [15, 284], field: value})
            assert err["param"] == field
            assert err["message"].startswith(f"{field} cannot be combined with trace_decode_token_ids")
