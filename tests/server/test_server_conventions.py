"""vLLM's conventions over HTTP: /ping, chat_template_kwargs, continue_final_message, priority, a lower-case
bearer scheme, several --served-model-name names, --enable-log-requests. One server on a copy of the embedded
model whose chat template reads Qwen3's `enable_thinking`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from helpers.server_utils import API_KEY, ENGINE_ARGS, RemoteServer

from replayllm import LLM, SamplingParams
from replayllm.config import DEFAULT_MODEL
from replayllm.model_source import resolve_model_path

NAME, ALIAS = "thinker", "alias"
USER = [{"role": "user", "content": "hi"}]
PARTIAL = [*USER, {"role": "assistant", "content": "Once upon a"}]
NO_THINKING = ("{%- if enable_thinking is defined and enable_thinking is false %}"
               "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> Path:
    """The embedded model (weights linked, not copied) with Qwen3's enable_thinking switch in its template."""
    src = Path(resolve_model_path(DEFAULT_MODEL))
    dst = tmp_path_factory.mktemp("thinking_model")
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            os.symlink(f, dst / f.name)
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    gen_prompt = "{{- '<|im_start|>assistant\\n' }}"
    assert gen_prompt in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(gen_prompt, gen_prompt + NO_THINKING)
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def server(thinking_model, tmp_path_factory):
    srv = RemoteServer([str(thinking_model), *ENGINE_ARGS, "--api-key", API_KEY, "--served-model-name", NAME, ALIAS,
                        "--enable-log-requests"],
                       tmp_path_factory.mktemp("server_conventions"), api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(thinking_model):
    return LLM(str(thinking_model), dtype="float32", device="cpu", max_model_len=512)


def post(server, path: str, body: dict, auth: str | None = None) -> httpx.Response:
    headers = {"Authorization": auth} if auth is not None else server.headers
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def tokenize_chat(server, **fields) -> list[int]:
    r = post(server, "/tokenize", {"messages": USER, **fields})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def rendered(llm, messages, **kwargs) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)


def error(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    return err["message"]


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping(server, method):
    r = httpx.request(method, server.url + "/ping", timeout=30)  # like /health: no key needed
    assert r.status_code == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_bearer_scheme_is_case_insensitive(server, scheme):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("auth", [f"Basic {API_KEY}", API_KEY, f"bearer {API_KEY}x", "bearer"])
def test_other_schemes_and_wrong_keys_are_401(server, auth):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": auth}, timeout=30)
    assert r.status_code == 401


def test_chat_template_kwargs_reach_the_template(server, llm):
    plain = tokenize_chat(server)
    no_thinking = tokenize_chat(server, chat_template_kwargs={"enable_thinking": False})
    assert plain == rendered(llm, USER, add_generation_prompt=True)
    assert no_thinking == rendered(llm, USER, add_generation_prompt=True, enable_thinking=False)
    assert len(no_thinking) > len(plain)
    r = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                                              "chat_template_kwargs": {"enable_thinking": False},
                                              "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == no_thinking


@pytest.mark.parametrize("kwargs, part", [
    ({"add_generation_prompt": False}, "may not set 'add_generation_prompt'"),
    ({"messages": []}, "may not set 'messages'"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_template_kwargs_the_template_cannot_use_are_400(server, kwargs, part, path):
    r = post(server, path, {"messages": USER, "max_tokens": 1, "chat_template_kwargs": kwargs}
             if path != "/tokenize" else {"messages": USER, "chat_template_kwargs": kwargs})
    assert part in error(r, 400, "chat_template_kwargs")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_template_kwargs_the_template_does_not_read_are_dropped_and_named(server, path):
    """As vLLM: dropped, but named in the x-replayllm-ignored-fields header (a 400 with --strict-request-fields:
    test_request_fields.py)."""
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinkin": False}}
    r = post(server, path, {**body, "max_tokens": 1, "return_token_ids": True} if path != "/tokenize" else body)
    assert r.status_code == 200, r.text
    assert r.headers["x-replayllm-ignored-fields"] == "chat_template_kwargs.enable_thinkin"
    tokens = r.json()["prompt_token_ids" if path != "/tokenize" else "tokens"]
    assert tokens == tokenize_chat(server)


def test_llm_chat_takes_chat_template_kwargs(llm):
    out = llm.chat(USER, SamplingParams(max_tokens=1), use_tqdm=False,
                   chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt_token_ids == rendered(llm, USER, add_generation_prompt=True, enable_thinking=False)
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(USER, use_tqdm=False, chat_template_kwargs={"nope": 1})


def test_continue_final_message(server, llm):
    expected = rendered(llm, PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert llm.get_tokenizer().decode(expected).endswith("<|im_start|>assistant\nOnce upon a")
    r = post(server, "/v1/chat/completions", {"messages": PARTIAL, "max_tokens": 2, "add_generation_prompt": False,
                                              "continue_final_message": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == expected
    out = llm.chat(PARTIAL, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt_token_ids == expected


def test_continue_final_message_with_a_generation_prompt_is_an_error(server, llm):
    r = post(server, "/v1/chat/completions", {"messages": PARTIAL, "max_tokens": 2, "continue_final_message": True})
    assert "cannot both be true" in error(r, 400, "continue_final_message")
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.chat(PARTIAL, use_tqdm=False, continue_final_message=True)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                                        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1})])
def test_priority_zero_is_accepted_other_values_are_400(server, path, body):
    assert post(server, path, {**body, "priority": 0}).status_code == 200
    r = post(server, path, {**body, "priority": 5})
    assert "priority scheduling is not enabled" in error(r, 400, "priority")


def test_several_served_model_names(server):
    models = httpx.get(server.url + "/v1/models", headers=server.headers, timeout=30).json()
    assert [m["id"] for m in models["data"]] == [NAME, ALIAS]
    for name in (NAME, ALIAS, None):
        r = post(server, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == NAME  # the first name is the one reported
    assert httpx.get(server.url + f"/v1/models/{ALIAS}", headers=server.headers, timeout=30).status_code == 200
    r = post(server, "/v1/completions", {"model": "other", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    assert f"`{NAME}`, `{ALIAS}`" in r.json()["error"]["message"]


def test_enable_log_requests_logs_ids_and_sizes_never_text(server):
    r = post(server, "/v1/completions", {"prompt": "a very secret prompt", "max_tokens": 3, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "another secret"}],
                                              "max_tokens": 2})
    assert r.status_code == 200, r.text
    log = server.log()  # the line is written before the response is sent
    line = next(line for line in log.splitlines() if body["id"] in line)
    assert f"1 prompt(s) of [{body['usage']['prompt_tokens']}] tokens" in line
    assert "max_tokens=3" in line and "logprobs=1" in line
    assert r.json()["id"] in log
    assert "secret" not in log
