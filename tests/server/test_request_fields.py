"""Request bodies' unknown fields (request_fields.py): ignored, logged and named in x-replayllm-ignored-fields by
default, as vLLM accepts them; 400s with --strict-request-fields. Plus what vLLM clients send that has a meaning:
guided_* (structured_outputs' older spellings), reasoning_effort (a chat-template variable), echo with
max_tokens 0 (prompt scoring), and --reasoning-parser's reasoning_content. In-process apps on one engine."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.openai.api_server import build_app
from replayllm.entrypoints.openai.request_fields import IGNORED_HEADER

USER = [{"role": "user", "content": "hi"}]
CHAT = {"messages": USER, "max_tokens": 2, "temperature": 0, "return_token_ids": True}
PROMPT = "Once upon a time there was"
COMPLETION = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
# A template that reads one extra variable (enable_thinking), as Qwen3's does.
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if enable_thinking is defined and enable_thinking is false %}[no thinking]{% endif %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32", max_model_len=256, enable_trace_replay=True)


def client(llm, **kwargs) -> TestClient:
    """An app on the module's engine (its loop runs while the client's `with` block does)."""
    return TestClient(build_app(engine=llm.llm_engine, **kwargs))


def error(r, param: str, part: str = "") -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and part in err["message"], err
    return err


# -- tolerant (default) ---------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_logged_and_named(llm, caplog):
    extras = {"service_tier": "auto", "prompt_cache_key": "k", "verbosity": "low", "safety_identifier": "u1",
              "modalities": ["text"], "functions": [], "a,b": 1, "ü": 2}
    with client(llm) as c, caplog.at_level(logging.WARNING, "replayllm.server"):
        plain = c.post("/v1/completions", json=COMPLETION)
        r = c.post("/v1/completions", json={**COMPLETION, **extras})
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED_HEADER] == ("service_tier, prompt_cache_key, verbosity, safety_identifier, "
                                             "modalities, functions, a%2Cb, %C3%BC")
        assert r.json()["choices"] == plain.json()["choices"]
        assert IGNORED_HEADER not in plain.headers
        stream = c.post("/v1/completions", json={**COMPLETION, "stream": True, "service_tier": "auto"})
        assert stream.status_code == 200 and stream.headers[IGNORED_HEADER] == "service_tier"
        chat = c.post("/v1/chat/completions", json={**CHAT, "prompt_cache_key": "k"})
        assert chat.status_code == 200 and chat.headers[IGNORED_HEADER] == "prompt_cache_key"
        tok = c.post("/tokenize", json={"messages": USER, "max_tokens": 2})
        assert tok.status_code == 200 and tok.headers[IGNORED_HEADER] == "max_tokens"
        detok = c.post("/detokenize", json={"tokens": [15], "skip_special_tokens": True})
        assert detok.status_code == 200 and detok.headers[IGNORED_HEADER] == "skip_special_tokens"
    lines = [rec.getMessage() for rec in caplog.records if "does not know" in rec.getMessage()]
    assert lines and "'service_tier', 'prompt_cache_key'" in lines[0] and "--strict-request-fields" in lines[0]


def test_known_fields_replayllm_cannot_honour_stay_400s(llm):
    """Tolerance is for unknown fields: known ones with values the server cannot honour keep their 400s."""
    with client(llm) as c:
        error(c.post("/v1/completions", json={**COMPLETION, "suffix": "!"}), "suffix")
        error(c.post("/v1/completions", json={**COMPLETION, "use_beam_search": True, "top_p": 0.9}), "top_p")
        error(c.post("/v1/completions", json={**COMPLETION, "logit_bias": {"hello": 1}}), "logit_bias")
        error(c.post("/v1/chat/completions", json={**CHAT, "chat_template": "{{ x }}"}), "chat_template")


def test_unknown_keys_of_nested_objects_are_ignored_and_named_by_path(llm):
    """vLLM ignores unknown keys inside nested objects too (stream_options.include_obfuscation, a text part's
    cache_control): ignored and named by their path; a 400 with --strict-request-fields."""
    chat = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                "cache_control": {"type": "ephemeral"}}]}],
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    with client(llm) as c:
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED_HEADER] == "messages.0.content.0.cache_control, stream_options.include_obfuscation"
        assert '"usage":{"prompt_tokens"' in r.text  # the known key next to the unknown one still works
    with client(llm, strict_request_fields=True) as c:
        error(c.post("/v1/completions", json={**COMPLETION, "stream": True, "stream_options": {"foo": 1}}),
              "stream_options.foo", "Unrecognized request argument")


def test_template_variables_the_template_does_not_read_are_dropped_and_named(llm):
    with client(llm, chat_template=TEMPLATE) as c:
        plain = c.post("/v1/chat/completions", json=CHAT).json()["prompt_token_ids"]
        r = c.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "low",
                                                 "chat_template_kwargs": {"nope": 1, "enable_thinking": False}})
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED_HEADER] == "chat_template_kwargs.nope, reasoning_effort"
        no_thinking = r.json()["prompt_token_ids"]
        assert no_thinking != plain  # the variable the template reads still reaches it
        tok = c.post("/tokenize", json={"messages": USER, "chat_template_kwargs": {"nope": 1,
                                                                                   "enable_thinking": False}})
        assert tok.headers[IGNORED_HEADER] == "chat_template_kwargs.nope"
        assert tok.json()["tokens"] == no_thinking
        error(c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"tokenize": True}}),
              "chat_template_kwargs", "may not set 'tokenize'")
    reads = TEMPLATE.replace("enable_thinking is defined and enable_thinking is false",
                             "reasoning_effort == 'low'")
    with client(llm, chat_template=reads) as c:
        low = c.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "low"})
        assert low.status_code == 200 and IGNORED_HEADER not in low.headers
        assert low.json()["prompt_token_ids"] == no_thinking  # "[no thinking]" rendered from reasoning_effort


# -- strict ---------------------------------------------------------------------------------------------------
def test_strict_mode_refuses_unknown_fields(llm):
    with client(llm, strict_request_fields=True, chat_template=TEMPLATE) as c:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                           ("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": USER}),
                           ("/detokenize", {"tokens": [15]}), ("/v1/responses", {"input": "hi"}),
                           ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {}})):
            err = error(c.post(path, json={**body, "service_tier": "auto"}), "service_tier",
                        "Unrecognized request argument supplied: service_tier")
            assert err["code"] == "unknown_parameter"
        error(c.post("/v1/completions", json={**COMPLETION, "guided_decoding_backend": "xgrammar"}),
              "guided_decoding_backend")
        for kwargs in ({"nope": 1}, {"reasoning_effort": "low"}):
            error(c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": kwargs}),
                  "chat_template_kwargs", "not used by this model's chat template")
        error(c.post("/v1/chat/completions", json={**CHAT, "reasoning_effort": "low"}), "chat_template_kwargs",
              "['reasoning_effort'] are not used")
        ok = c.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
        assert ok.status_code == 200 and IGNORED_HEADER not in ok.headers
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        assert schemas["CompletionRequest"]["additionalProperties"] is False
    with client(llm) as c:
        assert c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"][
            "additionalProperties"] is True


# -- guided_* ---------------------------------------------------------------------------------------------------
def test_guided_fields_are_structured_outputs(llm):
    with client(llm) as c:
        for guided, structured in ((("guided_choice", ["yes", "no"]), ("choice", ["yes", "no"])),
                                   (("guided_regex", "[a-z]{2,5}"), ("regex", "[a-z]{2,5}")),
                                   (("guided_json", {"type": "object"}), ("json", {"type": "object"}))):
            body = {**COMPLETION, "max_tokens": 12}
            a = c.post("/v1/completions", json={**body, guided[0]: guided[1], "guided_decoding_backend": "x"})
            b = c.post("/v1/completions", json={**body, "structured_outputs": dict([structured])})
            assert a.status_code == 200, a.text
            assert a.json()["choices"] == b.json()["choices"]
            assert a.headers[IGNORED_HEADER] == "guided_decoding_backend"
        assert c.post("/v1/completions", json={**COMPLETION, "guided_choice": ["yes", "no"]}).json()[
            "choices"][0]["text"] in ("yes", "no")
        error(c.post("/v1/completions", json={**COMPLETION, "guided_regex": "a(b"}), "guided_regex", "guided_regex")
        error(c.post("/v1/completions", json={**COMPLETION, "guided_regex": "a", "guided_choice": ["a"]}),
              "guided_choice", "not several")
        error(c.post("/v1/completions", json={**COMPLETION, "guided_regex": "a", "structured_outputs": {
            "regex": "b"}}), "guided_regex", "not both")
        error(c.post("/v1/chat/completions", json={**CHAT, "guided_json": {"type": "object"}, "response_format": {
            "type": "json_object"}}), "guided_json", "not both")


# -- echo with max_tokens 0 -------------------------------------------------------------------------------------
def test_echo_with_max_tokens_0_returns_the_scored_prompt(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 2}
    with client(llm) as c:
        r = c.post("/v1/completions", json=body)
        stream = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        no_logprobs = c.post("/v1/completions", json={**body, "logprobs": None, "prompt": [ids, ids]})
        error(c.post("/v1/completions", json={**body, "echo": False}), "max_tokens", "0 with echo")
        error(c.post("/v1/completions", json={**body, "logprobs": None, "trace_decode_token_ids": [15]}),
              "trace_decode_token_ids", "prompt only")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    assert lp["token_logprobs"][1:] == [ref.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i]
    assert [set(top) for top in lp["top_logprobs"][1:]] == [
        {lps.decoded_token for lps in ref.prompt_logprobs[i].values()} for i in range(1, len(ids))]
    events = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    chunks = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(ch["text"] for ch in chunks) == PROMPT and chunks[-1]["finish_reason"] == "length"
    assert sum((ch["logprobs"]["token_logprobs"] for ch in chunks), []) == lp["token_logprobs"]
    assert events[-1]["usage"]["completion_tokens"] == 0
    assert [ch["text"] for ch in no_logprobs.json()["choices"]] == [PROMPT, PROMPT]


# -- --reasoning-parser -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>Let me see.</think>It is four.", "Let me see.", "It is four."),
    ("It is four.", None, "It is four."),
    ("<think>Still thinking", "Still thinking", None),
])
def test_reasoning_parser_splits_think_from_content(llm, text, reasoning, content):
    trace = llm.get_tokenizer().encode(text, add_special_tokens=False)
    body = {**CHAT, "max_tokens": None, "trace_decode_token_ids": trace}
    with client(llm, reasoning_parser="qwen3") as c:
        r = c.post("/v1/chat/completions", json=body)
        stream = c.post("/v1/chat/completions", json={**body, "stream": True})
    with client(llm) as c:
        raw = c.post("/v1/chat/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0][
            "message"]
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    assert (raw["reasoning_content"], raw["content"]) == (None, text)  # no parser: the text as it is
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in stream.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert "".join(d.get("content") or "" for d in deltas) == (content or "")


def test_reasoning_parser_keeps_tags_a_tokenizer_marks_special(tmp_path):
    """A tokenizer that marks <think> / </think> special (DeepSeek-R1's do; Qwen3's do not): with a parser, a
    request that leaves skip_special_tokens unset keeps them in the text, so the split still finds them."""
    import os

    from transformers import AutoTokenizer

    from replayllm.config import DEFAULT_MODEL
    from replayllm.model_source import resolve_model_path
    src = resolve_model_path(DEFAULT_MODEL)
    for name in os.listdir(src):
        if not name.startswith("tokenizer"):
            os.symlink(os.path.join(src, name), tmp_path / name)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tok.save_pretrained(tmp_path)
    special = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=256, enable_trace_replay=True)
    text = "<think>Let me see.</think>It is four."
    body = {**CHAT, "max_tokens": None, "trace_decode_token_ids": tok.encode(text, add_special_tokens=False)}
    with client(special, reasoning_parser="qwen3") as c:
        message = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "It is four.")
    with client(special) as c:  # no parser: skip_special_tokens (true) drops the special tags
        assert c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] == \
            "Let me see.It is four."


def test_a_token_id_prompt_meets_list_int_before_list_str():
    """CompletionRequest.prompt's union lists list[int] before list[str]: pydantic's union stops at the first exact
    match, and a token-id prompt tried against list[str] first built one error object per id (a 512-id request:
    46 µs of validation, 10 after). The order shows in the JSON schema; every prompt form still parses to itself."""
    from replayllm.entrypoints.openai.openai_protocol import CompletionRequest

    kinds = [(s["type"], s.get("items", {}).get("type")) for s in
             CompletionRequest.model_json_schema()["properties"]["prompt"]["anyOf"]]
    assert kinds.index(("array", "integer")) < kinds.index(("array", "string"))
    for prompt in ("x", ["a", "b"], [1, 2], [[1], [2, 3]]):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1.0, 2e0]}).prompt == [1, 2]
    for bad in ([1, "a"], [1.5], [True]):
        with pytest.raises(ValueError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's truncate_prompt_tokens on both generation routes: the model sees the prompt's last k tokens (the
    usage counts them, the output equals the truncated prompt's); -1 keeps max_model_len - 1; a text prompt
    longer than the context is cut, not refused; 0 and k >= max_model_len are 400s naming the field."""
    ids = [(7 * i) % 200 + 20 for i in range(300)]  # 300 ids, more than max_model_len (256)
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0}
    with client(llm) as c:
        error(c.post("/v1/completions", json=body), "prompt")  # too long without truncation
        cut = c.post("/v1/completions", json={**body, "truncate_prompt_tokens": 10})
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 10
        same = c.post("/v1/completions", json={**body, "prompt": ids[-10:], "return_token_ids": True})
        assert cut.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
        most = c.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1})
        assert most.status_code == 200 and most.json()["usage"]["prompt_tokens"] == 255
        text = c.post("/v1/completions", json={"prompt": "once upon a time " * 200, "max_tokens": 2,
                                               "truncate_prompt_tokens": 12, "echo": True})
        assert text.status_code == 200, text.text
        assert text.json()["usage"]["prompt_tokens"] == 12
        assert len(text.json()["choices"][0]["text"]) < 200  # the echo shows the 12 tokens the model saw
        chat = c.post("/v1/chat/completions", json={**CHAT, "truncate_prompt_tokens": 3})
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3
        gen = c.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {
            "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 10}})
        assert gen.status_code == 200, gen.text
        assert gen.json()["choices"][0]["token_ids"] == same.json()["choices"][0]["token_ids"]
        error(c.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0}), "truncate_prompt_tokens")
        error(c.post("/v1/completions", json={**body, "truncate_prompt_tokens": 256}), "truncate_prompt_tokens",
              "max_model_len")


def test_logit_bias_over_http_is_clamped_to_openais_range():
    """vLLM's OpenAI path clamps to [-100, 100] (SamplingParams itself takes any finite bias)."""
    from replayllm.entrypoints.openai.openai_protocol import _token_id_keys
    assert _token_id_keys({"5": 250.0, "6": -1e9, "7": 1.5}) == {5: 100.0, 6: -100.0, 7: 1.5}
