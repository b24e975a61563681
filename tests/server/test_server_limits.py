"""Fail-safe limits against the real server: oversized bodies (413), too many sequences / stop strings / bad words /
messages / characters (400 before the engine sees anything), invalid Unicode (400 naming the field, never a
500), and error bodies that stay small however large the input. The server keeps serving afterwards."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
from helpers.server_utils import API_KEY, ENGINE_ARGS, RemoteServer

BODY_LIMIT = 100_000
LIMIT_ARGS = ["--max-request-body-bytes", str(BODY_LIMIT), "--max-sequences-per-request", "16",
              "--max-stop-strings", "4", "--max-bad-words", "4", "--max-chat-messages", "8",
              "--max-prompt-chars", "2000"]
OK = {"prompt": "Once upon a time", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MAX_ERROR_BODY = 2048  # bytes: an error body never echoes a large input


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay", "--api-key", API_KEY, *LIMIT_ARGS],
                       tmp_path_factory.mktemp("server_limits"), api_key=API_KEY)
    yield srv
    srv.stop()


def post(server, path: str, body) -> httpx.Response:
    """Body as JSON with ASCII escapes (so lone surrogates travel as "\\ud800"), or raw bytes / a generator."""
    content = body if isinstance(body, bytes) or not isinstance(body, dict) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


def check_error(r: httpx.Response, status: int, param, part: str, code=None) -> dict:
    assert r.status_code == status, r.text
    assert len(r.content) <= MAX_ERROR_BODY, len(r.content)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert part in err["message"], err
    return err


def requests_added(server) -> float:
    return server.metrics()["replayllm:requests_added_total"]


U = "\ud800"  # a lone surrogate: valid JSON ("\ud800"), not valid Unicode text
CASES = [
    # (id, path, body, status, param, message part, code)
    ("too-many-sequences", "/v1/completions", {**OK, "prompt": ["a"] * 8, "n": 4}, 400, "prompt",
     "--max-sequences-per-request", "limit_exceeded"),
    ("too-many-sequences-n", "/v1/completions", {**OK, "n": 17}, 400, "n", "--max-sequences-per-request",
     "limit_exceeded"),
    ("chat-too-many-sequences", "/v1/chat/completions", {**CHAT, "n": 17}, 400, "n", "x n=17", "limit_exceeded"),
    ("too-many-stop", "/v1/completions", {**OK, "stop": ["a"] * 5}, 400, "stop", "--max-stop-strings",
     "limit_exceeded"),
    ("too-many-bad-words", "/v1/completions", {**OK, "bad_words": ["a"] * 5}, 400, "bad_words", "--max-bad-words",
     "limit_exceeded"),
    ("too-many-messages", "/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 9}, 400, "messages",
     "--max-chat-messages", "limit_exceeded"),
    ("tokenize-too-many-messages", "/tokenize", {"messages": CHAT["messages"] * 9}, 400, "messages",
     "--max-chat-messages", "limit_exceeded"),
    ("prompt-too-many-chars", "/v1/completions", {**OK, "prompt": "x" * 2001}, 400, "prompt", "--max-prompt-chars",
     "limit_exceeded"),
    ("chat-too-many-chars", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "x" * 1500}] * 2}, 400, "messages", "--max-prompt-chars",
     "limit_exceeded"),
    ("tokenize-too-many-chars", "/tokenize", {"prompt": "x" * 2001}, 400, "prompt", "--max-prompt-chars",
     "limit_exceeded"),
    ("stop-too-many-chars", "/v1/completions", {**OK, "stop": ["x" * 1500, "y" * 600]}, 400, "stop",
     "--max-prompt-chars", "limit_exceeded"),
    ("stop-str-too-many-chars", "/v1/completions", {**OK, "stop": "x" * 2001}, 400, "stop", "--max-prompt-chars",
     "limit_exceeded"),
    ("bad-words-too-many-chars", "/v1/chat/completions", {**CHAT, "bad_words": ["x" * 2001]}, 400, "bad_words",
     "--max-prompt-chars", "limit_exceeded"),
    ("trace-over-max-trace-ids", "/v1/completions", {**OK, "trace_decode_token_ids": [15] * 2049}, 400,
     "trace_decode_token_ids", "--max-trace-ids", "limit_exceeded"),  # default: max_model_len x 4
    ("prompt-ids-longer-than-context", "/v1/completions", {**OK, "prompt": [[15] * 513]}, 400, "prompt",
     "max_model_len", "limit_exceeded"),
    # invalid Unicode: a 400 naming the field (it was a 500 from the tokenizer)
    ("surrogate-prompt", "/v1/completions", {**OK, "prompt": "a" + U}, 400, "prompt", "U+D800", "invalid_unicode"),
    ("surrogate-prompt-list", "/v1/completions", {**OK, "prompt": ["ok", U]}, 400, "prompt.1", "prompt[1]",
     "invalid_unicode"),
    ("surrogate-stop", "/v1/completions", {**OK, "stop": ["ok", U]}, 400, "stop.1", "stop[1]", "invalid_unicode"),
    ("surrogate-stop-str", "/v1/completions", {**OK, "stop": U}, 400, "stop", "stop", "invalid_unicode"),
    ("surrogate-bad-words", "/v1/completions", {**OK, "bad_words": [U]}, 400, "bad_words.0", "bad_words[0]",
     "invalid_unicode"),
    ("surrogate-chat", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" + U}]}, 400,
     "messages.0.content", "messages[0].content", "invalid_unicode"),
    ("surrogate-chat-part", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": U}]}]}, 400,
     "messages.0.content.0.text", "messages[0].content[0].text", "invalid_unicode"),
    ("surrogate-chat-stop", "/v1/chat/completions", {**CHAT, "stop": [U]}, 400, "stop.0", "stop[0]",
     "invalid_unicode"),
    ("surrogate-tokenize", "/tokenize", {"prompt": U}, 400, "prompt", "U+D800", "invalid_unicode"),
    ("surrogate-tokenize-chat", "/tokenize", {"messages": [{"role": "user", "content": U}]}, 400,
     "messages.0.content", "messages[0].content", "invalid_unicode"),
    ("surrogate-model", "/v1/completions", {**OK, "model": U}, 400, "model", "U+D800", "invalid_unicode"),
    ("surrogate-low", "/v1/completions", {**OK, "prompt": "\udfff"}, 400, "prompt", "U+DFFF", "invalid_unicode"),
    # structured outputs' constraints are measured (--max-structured-schema-bytes) before the text check: a 400 too
    ("surrogate-choice", "/v1/completions", {**OK, "structured_outputs": {"choice": ["a", U]}}, 400,
     "structured_outputs.choice.1", "U+D800", "invalid_unicode"),
    ("surrogate-regex", "/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a" + U}}, 400,
     "structured_outputs.regex", "U+D800", "invalid_unicode"),
    # large inputs: the error names the position, the body stays small
    ("trace-one-negative-id", "/v1/completions", {**OK, "trace_decode_token_ids": [15] * 400 + [-5] + [15] * 100},
     400, "trace_decode_token_ids", "trace_decode_token_ids[400] = -5 is negative", None),
    ("stop-one-empty", "/v1/completions", {**OK, "stop": ["a", "b", ""]}, 400, "stop", "stop[2] is an empty string",
     None),
    ("prompt-ids-negative", "/v1/completions", {**OK, "prompt": [[15], [15, -2]]}, 400, "prompt",
     "prompt[1][1] = -2", None),
    ("detokenize-too-many-ids", "/detokenize", {"tokens": [15] * 513}, 400, "tokens", "more than max_model_len (512)",
     "limit_exceeded"),
    ("detokenize-one-out-of-vocab", "/detokenize", {"tokens": [15] * 100 + [10**7] + [15] * 100}, 400, "tokens",
     "tokens[100] = 10000000", None),
    ("logit-bias-huge-key", "/v1/completions", {**OK, "logit_bias": {"x" * 20000: 1.0}}, 400, "logit_bias",
     "characters, cut", None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rejected_before_the_engine(server, case):
    _, path, body, status, param, part, code = case
    before = requests_added(server)
    check_error(post(server, path, body), status, param, part, code)
    assert requests_added(server) == before  # nothing reached the engine


def test_body_over_the_limit_is_413_from_content_length(server):
    before = requests_added(server)
    err = check_error(post(server, "/v1/completions", {**OK, "prompt": "x" * BODY_LIMIT}), 413, None,
                      "--max-request-body-bytes", "request_too_large")
    assert str(BODY_LIMIT) in err["message"]
    assert requests_added(server) == before


def test_body_over_the_limit_is_413_while_streaming_it_in(server):
    """No Content-Length (chunked): the bytes are counted as they arrive."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 10_000 + 2):
            yield b"x" * 10_000
        yield b'", "max_tokens": 2}'

    check_error(post(server, "/v1/completions", chunks()), 413, None, "--max-request-body-bytes",
                "request_too_large")


def test_body_at_the_limit_is_parsed(server):
    body = json.dumps({**OK, "prompt": "x" * 1999}).encode()
    assert len(body) < BODY_LIMIT
    assert post(server, "/v1/completions", body).status_code == 200


def test_unauthenticated_large_body_is_401(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (BODY_LIMIT + 1))
    assert r.status_code == 401


def test_limits_at_their_value_are_accepted(server):
    for path, body in (("/v1/completions", {**OK, "prompt": ["a"] * 4, "n": 4, "stop": ["q"] * 4,
                                            "bad_words": ["zz"] * 4}),
                       ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 8}),
                       ("/v1/completions", {**OK, "prompt": "x" * 1990 + "é" * 10}),
                       ("/v1/completions", {**OK, "prompt": "smile \U0001F600"})):  # a proper surrogate pair
        r = post(server, path, body)
        assert r.status_code == 200, (path, r.text)


def test_trace_longer_than_the_context_is_cut_as_llm_cuts_it(server):
    """Not a limit: a trace longer than max_model_len leaves is cut to fit (trace_rules.fit), as LLM.generate
    cuts it; finish_reason "length"."""
    trace = [15, 284, 11] * 171  # 513 ids; the prompt is 4 tokens of the 512
    # max_tokens past the context is no 400 with a trace (the trace's length is max_tokens: ServingBase.check_room)
    r = post(server, "/v1/completions", {**OK, "trace_decode_token_ids": trace, "trace_replay_chunk_size": 64,
                                         "return_token_ids": True, "max_tokens": 600})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == trace[:512 - 4] and choice["finish_reason"] == "length"


def test_server_keeps_serving(server):
    for case in CASES[:3]:
        post(server, case[1], case[2])
    r = post(server, "/v1/completions", {**OK, "trace_decode_token_ids": [15, 284, 11], "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [15, 284, 11], r.text
    m = server.wait_idle()
    assert not any('status="500"' in k for k in m), [k for k in m if "status" in k]
    assert m['replayllm:http_requests_total{route="/v1/completions",status="413"}'] >= 2


def test_serve_help_lists_limits(tmp_path):
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--max-request-body-bytes", "--max-sequences-per-request", "--max-stop-strings", "--max-bad-words",
                 "--max-chat-messages", "--max-prompt-chars", "--max-trace-ids"):
        assert flag in out.stdout


def test_serve_rejects_a_zero_limit(tmp_path):
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", "--max-stop-strings", "0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-stop-strings" in out.stderr
