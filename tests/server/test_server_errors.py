"""Bad requests against the real server: each gets the right 4xx in OpenAI's error shape, none is a 500, the
engine loop survives them all and no KV block leaks. Plus the trace-replay-off server and the CLI."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from helpers.server_utils import ENGINE_ARGS, RemoteServer

MODEL = "replayllm/tiny-qwen3"
OK = {"prompt": "Once upon a time", "max_tokens": 2}
TRACE = [15, 284, 11]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG_IDS = [15] * 600  # > max_model_len 512
TOK_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def server(shared_trace_server):
    return shared_trace_server


@pytest.fixture(scope="module")
def server_no_trace(tmp_path_factory):
    """Trace replay off; the key comes from the environment instead of --api-key."""
    srv = RemoteServer([*ENGINE_ARGS, "--max-num-seqs", "8", "--served-model-name", "plain"],
                       tmp_path_factory.mktemp("server_no_trace"), env={"REPLAYLLM_API_KEY": "env-key"},
                       api_key="env-key")
    yield srv
    srv.stop()


def completion(**fields):
    return ("/v1/completions", {**OK, **fields})


def chat(**fields):
    return ("/v1/chat/completions", {**CHAT, **fields})


# (id, path, body (dict, or raw bytes), expected status, expected `param` (None: not checked), message part).
# Unknown top-level fields are ignored by default and 400s with --strict-request-fields: test_request_fields.py.
CASES = [
    # malformed bodies
    ("bad-json", "/v1/completions", b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("body-not-object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("empty-body", "/v1/completions", b"", 400, None, ""),
    ("missing-prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", "required"),
    # wrong types (strict: no coercion)
    ("prompt-number", *completion(prompt=5), 400, "prompt", "must be a string"),
    ("prompt-float-ids", *completion(prompt=[1.5, 2]), 400, "prompt", ""),
    ("max-tokens-string", *completion(max_tokens="5"), 400, "max_tokens", ""),
    ("temperature-string", *completion(temperature="hot"), 400, "temperature", ""),
    ("logprobs-bool", *completion(logprobs=True), 400, "logprobs", ""),
    ("stream-string", *completion(stream="yes"), 400, "stream", ""),
    ("stop-number", *completion(stop=5), 400, "stop", ""),
    ("trace-not-list", *completion(trace_decode_token_ids="15,284"), 400, "trace_decode_token_ids", ""),
    ("trace-float-ids", *completion(trace_decode_token_ids=[15.5]), 400, "trace_decode_token_ids.0", ""),
    # out-of-range values
    ("prompt-empty-string", *completion(prompt=""), 400, None, "at least one token"),
    ("prompt-empty-list", *completion(prompt=[]), 400, "prompt", "empty"),
    ("prompt-negative-id", *completion(prompt=[-1, 5]), 400, "prompt", "token ids"),
    ("prompt-out-of-vocab", *completion(prompt=[10**7]), 400, "prompt", "token ids"),
    ("max-tokens-zero", *completion(max_tokens=0), 400, "max_tokens", ""),
    ("temperature-negative", *completion(temperature=-0.5), 400, "temperature", ""),
    ("top-p-zero", *completion(top_p=0), 400, "top_p", ""),
    ("top-p-above-one", *completion(top_p=1.5), 400, "top_p", ""),
    ("top-k-negative", *completion(top_k=-5), 400, "top_k", ""),
    ("min-p-above-one", *completion(min_p=2), 400, "min_p", ""),
    ("presence-penalty", *completion(presence_penalty=3), 400, "presence_penalty", ""),
    ("frequency-penalty", *completion(frequency_penalty=-3), 400, "frequency_penalty", ""),
    ("repetition-penalty-zero", *completion(repetition_penalty=0), 400, "repetition_penalty", ""),
    ("n-zero", *completion(n=0), 400, "n", ""),
    ("n-too-large", *completion(n=129), 400, "n", ""),
    ("logprobs-too-many", *completion(logprobs=21), 400, "logprobs", "max_logprobs"),
    ("logprobs-negative", *completion(logprobs=-2), 400, "logprobs", ""),
    # vLLM's -1 (the whole vocabulary) past the default max_logprobs 20
    ("logprobs-whole-vocab", *completion(logprobs=-1), 400, "logprobs", "the whole vocabulary"),
    ("seed-too-large", *completion(seed=2**70), 400, "seed", ""),
    ("stop-token-out-of-vocab", *completion(stop_token_ids=[10**7]), 400, "stop_token_ids", "vocabulary"),
    ("min-tokens-over-max", *completion(min_tokens=5, max_tokens=2), 400, "min_tokens", ""),
    ("over-long-prompt", *completion(prompt=LONG_IDS), 400, "prompt", "maximum context length is 512 tokens"),
    # vLLM's server: a max_tokens the prompt leaves no room for is a 400 (the offline LLM stops at the context)
    ("max-tokens-past-context", *completion(prompt=[15] * 510, max_tokens=10**12), 400, "max_tokens",
     "'max_tokens' or 'max_completion_tokens' is too large: 1000000000000. This model's maximum context length is "
     "512 tokens and your request has 510 input tokens (1000000000000 > 512 - 510)"),
    ("default-max-tokens-past-context", "/v1/completions", {"prompt": [15] * 500}, 400, "max_tokens",
     "(16 > 512 - 500)"),
    # trace replay rules
    ("trace-negative-id", *completion(trace_decode_token_ids=[15, -3]), 400, "trace_decode_token_ids", ""),
    ("trace-out-of-vocab", *completion(trace_decode_token_ids=[15, 999999]), 400, "trace_decode_token_ids",
     "vocabulary"),
    ("trace-empty", *completion(trace_decode_token_ids=[]), 400, "trace_decode_token_ids", ""),
    ("trace-n-2", *completion(trace_decode_token_ids=TRACE, n=2), 400, "n", "trace"),
    ("trace-prompt-logprobs", *completion(trace_decode_token_ids=TRACE, prompt_logprobs=1), 400,
     "prompt_logprobs", "trace"),
    ("trace-bad-words", *completion(trace_decode_token_ids=TRACE, bad_words=["x"]), 400, "bad_words", "trace"),
    ("trace-echo-logprobs", *completion(trace_decode_token_ids=TRACE, echo=True, logprobs=1), 400, "echo", ""),
    ("trace-logit-bias", *completion(trace_decode_token_ids=TRACE, logit_bias={"15": 5.0}), 400, "logit_bias",
     "trace"),
    ("trace-allowed-token-ids", *completion(trace_decode_token_ids=TRACE, allowed_token_ids=[15]), 400,
     "allowed_token_ids", "trace"),
    # logit_bias (OpenAI) and allowed_token_ids (vLLM extra)
    ("logit-bias-word-key", *completion(logit_bias={"hello": 5.0}), 400, "logit_bias", "decimal integers"),
    ("logit-bias-negative-key", *completion(logit_bias={"-1": 5.0}), 400, "logit_bias", "decimal integers"),
    ("logit-bias-duplicate-id", *completion(logit_bias={"7": 1.0, "007": 2.0}), 400, "logit_bias", "twice"),
    ("logit-bias-out-of-vocab", *completion(logit_bias={"999999": 5.0}), 400, "logit_bias", "vocabulary"),
    ("logit-bias-string-value", *completion(logit_bias={"15": "5"}), 400, "logit_bias.15", ""),
    ("logit-bias-not-object", *completion(logit_bias=[[15, 5.0]]), 400, "logit_bias", ""),
    ("chat-logit-bias-word-key", *chat(logit_bias={"x": 1}), 400, "logit_bias", "decimal integers"),
    ("allowed-token-ids-empty", *completion(allowed_token_ids=[]), 400, "allowed_token_ids", "non-empty"),
    ("allowed-token-ids-out-of-vocab", *completion(allowed_token_ids=[15, 10**7]), 400, "allowed_token_ids",
     "vocabulary"),
    ("allowed-token-ids-float", *completion(allowed_token_ids=[15.5]), 400, "allowed_token_ids.0", ""),
    # unsupported OpenAI options are refused, not ignored
    ("suffix", *completion(suffix="!"), 400, "suffix", ""),
    ("best-of", *completion(best_of=3), 400, "best_of", ""),
    ("stream-options-without-stream", *completion(stream_options={"include_usage": True}), 400,
     "stream_options", ""),
    # model
    ("unknown-model", *completion(model="gpt-4"), 404, "model", "does not exist"),
    # chat
    ("chat-missing-messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages", ""),
    ("chat-empty-messages", *chat(messages=[]), 400, "messages", ""),
    ("chat-bad-role", *chat(messages=[{"role": "wizard", "content": "hi"}]), 400, None, ""),
    ("chat-image-part", *chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, "messages.0.content", "must be a string or a list"),
    ("chat-top-logprobs-alone", *chat(top_logprobs=2), 400, "top_logprobs", "logprobs"),
    ("chat-top-logprobs-too-many", *chat(logprobs=True, top_logprobs=21), 400, "logprobs", "max_logprobs"),
    ("chat-tools", *chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools", ""),
    # structured outputs: a bad schema, regex or combination is a 400 naming the field, never a 500
    ("chat-json-schema-missing", *chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format", "needs json_schema"),
    # OpenAI's json_schema object typed strictly (QA: "strict": "yes" / 1 and a missing name were taken)
    ("chat-json-schema-no-name", *chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}), 400, "response_format", "name is required"),
    ("chat-json-schema-strict-str", *chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": "yes"}}), 400, "response_format", "a boolean"),
    ("completion-json-schema-strict-int", *completion(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": 1}}), 400, "response_format", "a boolean"),
    ("chat-json-schema-bad", *chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}), 400, "response_format", "invalid"),
    ("completion-response-format-type", *completion(response_format={"type": "xml"}), 400, "response_format.type", ""),
    ("structured-bad-regex", *completion(structured_outputs={"regex": "a(b"}), 400, "structured_outputs",
     "invalid"),
    ("structured-two-kinds", *completion(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
     "structured_outputs", "exactly one"),
    ("structured-unknown-key", *completion(structured_outputs={"ebnf": "x"}), 400, "structured_outputs",
     "unknown fields"),
    ("structured-and-response-format", *chat(structured_outputs={"regex": "a"},
                                             response_format={"type": "json_object"}), 400, "structured_outputs",
     "not both"),
    ("structured-with-trace", *completion(structured_outputs={"choice": ["a"]}, trace_decode_token_ids=TRACE), 400,
     "structured_outputs", "trace_decode_token_ids"),
    ("chat-max-completion-tokens-0", *chat(max_completion_tokens=0), 400, "max_completion_tokens", ""),
    ("chat-trace-out-of-vocab", *chat(trace_decode_token_ids=[10**6]), 400, "trace_decode_token_ids", ""),
    ("chat-trace-n-2", *chat(trace_decode_token_ids=TRACE, n=2), 400, "n", ""),
    ("chat-unknown-model", *chat(model="nope"), 404, "model", ""),
    ("chat-over-long", *chat(messages=[{"role": "user", "content": "word " * 600}]), 400, "messages", "max_model_len"),
    ("chat-max-tokens-past-context", *chat(max_tokens=600), 400, "max_tokens", "is too large: 600"),
    ("chat-max-completion-tokens-past-context", *chat(max_completion_tokens=600), 400, "max_completion_tokens",
     "is too large: 600"),
    # vLLM's /tokenize and /detokenize
    ("tokenize-bad-json", "/tokenize", b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("tokenize-body-not-object", "/tokenize", b'"hi"', 400, None, "JSON object"),
    ("tokenize-missing-prompt-and-messages", "/tokenize", {"model": MODEL}, 400, "prompt", "'prompt' or 'messages'"),
    ("tokenize-prompt-and-messages", "/tokenize", {"prompt": "hi", **TOK_CHAT}, 400, "messages", "not both"),
    ("tokenize-prompt-ids", "/tokenize", {"prompt": [15, 284]}, 400, "prompt", "string"),
    ("tokenize-empty-messages", "/tokenize", {"messages": []}, 400, "messages", ""),
    ("tokenize-bad-role", "/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None, ""),
    ("tokenize-generation-prompt-and-continue", "/tokenize", {**TOK_CHAT, "continue_final_message": True}, 400,
     "continue_final_message", "cannot both be true"),
    ("tokenize-request-chat-template", "/tokenize", {**TOK_CHAT, "chat_template": "{% for %}"}, 400, "chat_template",
     ""),
    ("tokenize-unknown-model", "/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("tokenize-chat-unknown-model", "/tokenize", {**TOK_CHAT, "model": "gpt-4"}, 404, "model", "does not exist"),
    ("detokenize-not-json", "/detokenize", b"tokens=15", 400, None, "not valid JSON"),
    ("detokenize-missing-tokens", "/detokenize", {"model": MODEL}, 400, "tokens", "required"),
    ("detokenize-tokens-not-list", "/detokenize", {"tokens": "15,284"}, 400, "tokens", ""),
    ("detokenize-float-id", "/detokenize", {"tokens": [15, 1.5]}, 400, "tokens.1", ""),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [15, 10**7]}, 400, "tokens", "must be in [0, "),
    ("detokenize-negative-id", "/detokenize", {"tokens": [-1]}, 400, "tokens", "must be in [0, "),
    ("detokenize-huge-id", "/detokenize", {"tokens": [2**70]}, 400, "tokens", "must be in [0, "),
    ("detokenize-unknown-model", "/detokenize", {"tokens": [15], "model": "gpt-4"}, 404, "model", "does not exist"),
]


def _check_error(r: httpx.Response, status: int, param, message_part: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert err["param"] == param, err
    assert message_part in err["message"], err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, case):
    _, path, body, status, param, message_part = case
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, timeout=30,
                       headers={**server.headers, "Content-Type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=30)
    _check_error(r, status, param, message_part)
    if path in ("/tokenize", "/detokenize"):  # nothing runs in the engine loop for these: check it is unharmed
        assert httpx.get(server.url + "/health").status_code == 200


POST_BODIES = {"/v1/completions": OK, "/v1/chat/completions": CHAT, "/tokenize": {"prompt": "hi"},
               "/detokenize": {"tokens": [15]}}


@pytest.mark.parametrize("path", [*POST_BODIES, "/v1/models"])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key(server, path, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(server.url + path, json=POST_BODIES[path], headers=headers) if path in POST_BODIES else \
        httpx.get(server.url + path, headers=headers)
    err = _check_error(r, 401, None, "API key")
    assert err["code"] == "invalid_api_key"


def test_unknown_routes_and_methods(server):
    _check_error(httpx.get(server.url + "/v1/nope", headers=server.headers), 404, None, "")
    _check_error(httpx.get(server.url + "/v1/completions", headers=server.headers), 405, None, "")
    _check_error(httpx.get(server.url + "/v1/models/nope", headers=server.headers), 404, "model", "")


def test_extreme_but_valid_values_are_not_server_errors(server):
    """Values the checks accept must not blow up inside a step (a 500 for every request in flight)."""
    for extra in ({"top_k": 10**12, "temperature": 1.0}, {"temperature": 1e300}, {"seed": 2**64 - 1},
                  {"repetition_penalty": 1e30, "temperature": 0}, {"prompt": [15] * 510, "max_tokens": None},
                  {"seed": -1}, {"top_k": -1}, {"n": 3, "stop": ["a", "bb"], "logprobs": 20}):
        r = httpx.post(server.base_url + "/completions", json={**OK, **extra}, headers=server.headers, timeout=60)
        assert r.status_code == 200, (extra, r.text)


def test_server_survives_the_battery(server):
    """After every bad request: healthy, a good request works, nothing leaked, no 500 was ever sent."""
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.base_url + "/completions", json={**OK, "trace_decode_token_ids": TRACE,
                                                           "return_token_ids": True}, headers=server.headers)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == TRACE
    m = server.wait_idle()
    assert not any('status="500"' in k for k in m), [k for k in m if "status" in k]
    assert m["replayllm:engine_step_errors_total"] == 0
    assert m['replayllm:http_requests_total{route="/v1/completions",status="400"}'] >= 35
    assert m['replayllm:http_requests_total{route="/tokenize",status="400"}'] >= 9
    assert m['replayllm:http_requests_total{route="/detokenize",status="400"}'] >= 7
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, headers=server.headers).json()["tokens"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, headers=server.headers)
    assert r.status_code == 200 and r.json() == {"prompt": "hi"}, r.text


@pytest.mark.parametrize("path, body", [("/v1/completions", {**OK, "trace_decode_token_ids": TRACE}),
                                        ("/v1/chat/completions", {**CHAT, "trace_decode_token_ids": TRACE})])
def test_trace_rejected_when_flag_off(server_no_trace, path, body):
    r = httpx.post(server_no_trace.url + path, json=body, headers=server_no_trace.headers)
    _check_error(r, 400, "trace_decode_token_ids", "--enable-trace-replay")


def test_flag_off_server_serves_plain_requests_with_env_key(server_no_trace):
    srv = server_no_trace
    assert httpx.post(srv.base_url + "/completions", json=OK).status_code == 401  # env key is enforced
    r = httpx.post(srv.base_url + "/completions", json={**OK, "model": "plain"}, headers=srv.headers)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "plain"
    _check_error(httpx.post(srv.base_url + "/completions", json={**OK, "model": MODEL}, headers=srv.headers),
                 404, "model", "")
    srv.wait_idle()


def test_serve_help_lists_options(tmp_path):
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--enable-trace-replay", "--host", "--port", "--api-key", "--served-model-name", "--dtype",
                 "--max-model-len", "--max-num-seqs", "--max-logprobs"):
        assert flag in out.stdout


def test_serve_rejects_bad_engine_option(tmp_path):
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", "--dtype", "int3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "dtype" in out.stderr


def test_tokenize_without_a_tokenizer_is_a_clear_400():
    """skip_tokenizer_init: /tokenize and /detokenize say why they cannot work, and the server keeps serving
    token-id prompts (an in-process app: no third server process to start)."""
    from fastapi.testclient import TestClient

    from replayllm.config import EngineConfig
    from replayllm.entrypoints.openai.api_server import build_app

    app = build_app(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512,
                                 skip_tokenizer_init=True))
    with TestClient(app) as c:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/tokenize", TOK_CHAT), ("/detokenize", {"tokens": [15]})):
            err = _check_error(c.post(path, json=body), 400, None, "--skip-tokenizer-init")
            assert err["message"].startswith(path + " needs a tokenizer"), err
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [15, 284], "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text
