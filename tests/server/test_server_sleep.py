"""Sleep mode and weight updates over HTTP (issue 29): vLLM's POST /sleep, POST /wake_up, GET /is_sleeping and
SGLang's POST /update_weights_from_disk, on both engine front-ends: the in-process app (build_app, the embedded
model, which has a tokenizer: chat is checked too) and a real `replayllm serve` whose engine runs in its own
process (EngineCoreClient; a tiny checkpoint, --skip-tokenizer-init). One server of each for the module."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers.server_utils import ENGINE_ARGS, RemoteServer

from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app

KEY = "sleep-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EMBEDDED = "replayllm/tiny-qwen3"
# Shorter than a KV block (16): no prefix-cache hit, so every request is the same computation (same engine,
# same batch of one): its greedy tokens and logprobs compare exactly across a sleep.
BODY = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        "logprobs": 1}
ADMIN = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"), ("post", "/update_weights_from_disk"),
         ("post", "/reset_prefix_cache")]


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def server(request, tiny_models, tmp_path_factory):
    """(an HTTP client that sends the key, the checkpoint the server was started from)."""
    if request.param == "in_process":
        config = EngineConfig(model=EMBEDDED, device="cpu", dtype="float32", max_model_len=512,
                              enable_sleep_mode=True)
        with TestClient(build_app(config, api_key=KEY), headers=AUTH) as client:
            yield client, EMBEDDED
        return
    path = tiny_models["qwen3"]
    srv = RemoteServer([path, *ENGINE_ARGS, "--skip-tokenizer-init", "--enable-sleep-mode", "--api-key", KEY],
                       tmp_path_factory.mktemp("sleep_server"), api_key=KEY)
    try:
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as client:
            yield client, path
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    """The server's client; the engine awake afterwards (a failing test must not leave the next one asleep)."""
    yield server[0]
    server[0].post("/wake_up")


@pytest.fixture
def model(server) -> str:
    return server[1]


def complete(client, **extra) -> tuple[list[int], list[float]]:
    r = client.post("/v1/completions", json={**BODY, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def is_sleeping(client) -> bool:
    r = client.get("/is_sleeping")
    assert r.status_code == 200, r.text
    return r.json()["is_sleeping"]


def assert_asleep_503(client, chat: bool) -> None:
    """Completions (JSON and streamed) and chat are refused with a 503 at once, before any stream starts."""
    calls = [("/v1/completions", BODY), ("/v1/completions", {**BODY, "stream": True})]
    if chat:
        calls.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
    for path, body in calls:
        r = client.post(path, json=body)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_asleep" and "/wake_up" in r.json()["error"]["message"]


def test_sleep_refuses_requests_and_wakes_to_the_same_tokens(client, model):
    before = complete(client)
    assert not is_sleeping(client)
    r = client.post("/sleep")  # level 1 by default
    assert r.status_code == 200 and r.content == b""
    assert is_sleeping(client)
    assert_asleep_503(client, chat=model == EMBEDDED)
    r = client.post("/wake_up")
    assert r.status_code == 200 and r.content == b""
    assert not is_sleeping(client)
    assert complete(client) == before  # level 1 kept the weights: the same tokens and logprobs, exactly


def test_level_2_then_new_weights_from_disk(client, model):
    """RL's cycle: sleep level 2 (weights dropped), wake the weights alone, load a checkpoint into them, then
    wake the KV cache; here the checkpoint is the served one, so the greedy tokens come back unchanged."""
    before = complete(client)
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert is_sleeping(client)  # the KV cache still is: requests are still refused
    assert_asleep_503(client, chat=False)
    r = client.post("/update_weights_from_disk", json={"model_path": model})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["num_tensors"] > 0 and body["message"]
    assert client.post("/wake_up", params={"tags": ["kv_cache"]}).status_code == 200
    assert not is_sleeping(client)
    assert complete(client) == before


def test_update_weights_from_a_bad_path_is_400_and_serving_goes_on(client, tmp_path):
    before = complete(client)
    for path in (str(tmp_path / "missing"), str(tmp_path)):  # no such folder; a folder without weights
        r = client.post("/update_weights_from_disk", json={"model_path": path})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and path in r.json()["error"]["message"]
    for name, data in (("model.safetensors", b"\xff" * 64), ("pytorch_model.bin", b"not a pickle")):
        bad = tmp_path / name.split(".")[-1]  # a corrupt weight file is the caller's: 400, not a 500
        bad.mkdir()
        (bad / name).write_bytes(data)
        r = client.post("/update_weights_from_disk", json={"model_path": str(bad)})
        assert r.status_code == 400 and "cannot read weight file" in r.json()["error"]["message"], r.text
    for body in ({}, {"model_path": 5}, {"model_path": "x", "load_format": "auto"}):  # refused, never ignored
        assert client.post("/update_weights_from_disk", json=body).status_code == 400
    for params in ({"level": 3}, {"level": "x"}):
        r = client.post("/sleep", params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == "level", r.text
    assert client.post("/wake_up", params={"tags": ["everything"]}).status_code == 400
    assert not is_sleeping(client)
    assert complete(client) == before


def test_admin_routes_need_the_api_key(client):
    for method, path in ADMIN:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            r = client.request(method, path, headers=headers, json={"model_path": "x"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert not is_sleeping(client)  # nothing happened
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200  # probes stay open
    assert client.get("/metrics", headers={"Authorization": ""}).status_code == 200


def test_sleep_with_a_request_in_flight_is_400(client):
    """The engine must be idle to sleep: the request in flight goes on and finishes, the engine stays awake."""
    # ~2 s of decoding here: the window for /sleep to meet it in flight, wide on any machine of the kind
    long = {**BODY, "prompt": [[5 + i, 6, 7] for i in range(2)], "max_tokens": 240, "ignore_eos": True}
    result: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: result.append(client.post("/v1/completions", json=long)))
    sender.start()
    try:
        deadline = time.monotonic() + 60
        while not running(client):
            assert time.monotonic() < deadline and sender.is_alive(), "the long request never ran"
            time.sleep(0.005)
        r = client.post("/sleep")
    finally:
        sender.join(120)
    assert r.status_code == 400 and "idle" in r.json()["error"]["message"], r.text
    assert result[0].status_code == 200, result[0].text
    assert not is_sleeping(client)
    complete(client)


def test_reset_prefix_cache_on_an_idle_engine_is_an_empty_200(client):
    """vLLM's POST /reset_prefix_cache: 200 with an empty body; serving goes on (the refusal while requests hold
    blocks: test_reset_prefix_cache_refused_is_a_409 below; the effect: tests/model_runner/test_load_weights.py)."""
    before = complete(client)
    r = client.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.content == b"", r.text
    assert complete(client) == before


def test_reset_prefix_cache_refused_is_a_409():
    """The engine answers False while requests hold KV blocks (nothing dropped): a 409 saying so, where vLLM
    answers 200 and keeps the cache."""
    from fastapi import FastAPI

    from replayllm.entrypoints.http.auth_middleware import error_response
    from replayllm.entrypoints.http.errors import APIError
    from replayllm.entrypoints.openai.serving_admin import admin_router

    class Busy:
        async def reset_prefix_cache(self) -> bool:
            return False

    app = FastAPI()
    app.include_router(admin_router(Busy()))
    app.add_exception_handler(APIError, lambda request, e: error_response(e))
    r = TestClient(app).post("/reset_prefix_cache")
    assert r.status_code == 409 and "not dropped" in r.json()["error"]["message"], r.text


def running(client) -> bool:
    text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("replayllm:num_requests_running"))
    return float(line.split()[-1]) > 0


def test_sleep_mode_off_is_a_400_naming_the_flag(tiny_models):
    config = EngineConfig(model=tiny_models["qwen3"], device="cpu", dtype="float32", max_model_len=256,
                          skip_tokenizer_init=True)
    with TestClient(build_app(config)) as client:
        r = client.post("/sleep")
        assert r.status_code == 400 and "--enable-sleep-mode" in r.json()["error"]["message"], r.text
        assert not is_sleeping(client)
        assert client.post("/wake_up").status_code == 200  # nothing asleep: nothing to do
        complete(client)
