"""MoE routes over HTTP (issue 30, docs/moe.md): `routed_experts` in /v1/completions choices with
--enable-return-routed-experts, and `trace_routed_experts` in the body, on both front-ends: the in-process app
(build_app) and a real `replayllm serve` whose engine runs in its own process (the routes cross it as int16
bytes, engine/core_messages.py). Each must equal the offline LLM's answer to the same request."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from helpers.server_utils import RemoteServer
from test_moe import _llm, _prompt, moe  # noqa: F401  (moe: the module's checkpoints fixture)

from replayllm import SamplingParams
from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app

OPTS = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4,
            enable_trace_replay=True, enable_return_routed_experts=True)
PROMPT = _prompt(11, 4)
# Every run computes the whole prompt (no prefix-cache reads), alone: the HTTP and the offline runs are the same
# computation, so their numbers are compared exactly.
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1,
        "return_token_ids": True, "skip_reading_prefix_cache": True}


@pytest.fixture(scope="module")
def offline(moe):  # noqa: F811
    return _llm(moe["norm"][0], enable_return_routed_experts=True)


@pytest.fixture(scope="module", params=["in_process", "core_process"])
def client(request, moe, tmp_path_factory):  # noqa: F811
    path = moe["norm"][0]
    if request.param == "in_process":
        with TestClient(build_app(EngineConfig(model=path, **OPTS))) as c:
            yield c
        return
    args = [path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
            "--skip-tokenizer-init", "--enable-trace-replay", "--enable-return-routed-experts"]
    srv = RemoteServer(args, tmp_path_factory.mktemp("moe_server"))
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c
    finally:
        srv.stop()


def _complete(client, **extra) -> dict:
    r = client.post("/v1/completions", json={**BODY, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _offline(llm, **params):
    p = dict(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, skip_reading_prefix_cache=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**{**p, **params}),
                        use_tqdm=False)[0].outputs[0]


def _logprobs(comp) -> list[float]:
    return [d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)]


def _same(http: list[float], offline: list[float]) -> bool:
    """Exactly equal: one request, its whole prompt computed, the same model and options on both sides."""
    return list(http) == list(offline)


def test_routes_equal_the_offline_llms(client, offline):
    choice = _complete(client)
    ref = _offline(offline)
    assert choice["token_ids"] == ref.token_ids
    assert np.array_equal(np.array(choice["routed_experts"]), ref.routed_experts)
    assert _same(choice["logprobs"]["token_logprobs"], _logprobs(ref))
    # Streamed: the closing chunk of the choice carries them.
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = [e["choices"][0] for e in events if e["choices"]][-1]
    assert last["finish_reason"] == "length" and last["routed_experts"] == ref.routed_experts.tolist()
    assert all("routed_experts" not in e["choices"][0] for e in events[:-1] if e["choices"])


def test_forced_routes_give_the_offline_logprobs(client, offline):
    mc = offline.llm_engine.model_config
    plain = _offline(offline)
    forced = plain.routed_experts[: len(PROMPT)].copy()
    forced[:, list(mc.moe_layers)] = (forced[:, list(mc.moe_layers)] + 3) % mc.num_experts
    trace = plain.token_ids
    choice = _complete(client, trace_decode_token_ids=trace, trace_routed_experts=forced.tolist())
    ref = _offline(offline, trace_decode_token_ids=trace, trace_routed_experts=forced)
    assert _same(choice["logprobs"]["token_logprobs"], _logprobs(ref))
    assert not _same(_logprobs(ref), _logprobs(plain))
    assert np.array_equal(np.array(choice["routed_experts"]), ref.routed_experts)
    assert np.array_equal(ref.routed_experts[: len(PROMPT)], forced)


@pytest.mark.parametrize("routes, message", [
    ([[0, 1]], "trace_routed_experts"),  # not 3-D: the body's type check
    ([[[0, 1], [-1, -1]]], r"must be \[positions, 3, 2\]"),
    ([[[0, 0], [-1, -1], [1, 2]]], "names one expert twice"),
    ([[[0, 9], [-1, -1], [1, 2]]], "past num_experts=8"),
    ([[[0, 1], [-1, -1], [1, 2]]] * 17, "17 positions, more than this request can run"),
])
def test_bad_routes_are_400s(client, routes, message):
    r = client.post("/v1/completions", json={**BODY, "trace_routed_experts": routes})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "trace_routed_experts" or "trace_routed_experts" in err["message"]
    assert re.search(message, err["message"]), err["message"]


def test_no_routes_field_without_the_option(moe):  # noqa: F811
    opts = {**OPTS, "enable_return_routed_experts": False}
    with TestClient(build_app(EngineConfig(model=moe["norm"][0], **opts))) as c:
        choice = _complete(c)
    assert "routed_experts" not in choice
