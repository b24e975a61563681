"""vLLM's -1 for logprobs / top_logprobs / prompt_logprobs (every token of the vocabulary) on a server started with
max_logprobs -1 (no cap): /v1/completions with echo (the prompt's logprobs follow `logprobs`), chat's top_logprobs;
the same request past the default max_logprobs is a 400 naming it (tests/server/test_server_errors.py). In-process
app, the embedded model (151,936 tokens): one prompt token, one output token."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def app():
    app = build_app(EngineConfig(dtype="float32", device="cpu", max_model_len=64, max_logprobs=-1))
    app.state.async_engine.start()
    yield app
    app.state.async_engine.stop()


def _post(app, route: str, body: dict) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return await c.post(route, json=body)
    return asyncio.run(main())


def test_echo_with_logprobs_minus_one_scores_every_token(app):
    vocab = app.state.async_engine.engine.model_config.vocab_size
    r = _post(app, "/v1/completions", {"prompt": [9707, 11], "max_tokens": 1, "temperature": 0, "echo": True,
                                      "logprobs": -1, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"][0] is None  # the first prompt token has no logprob
    for top in lp["top_logprobs"][1:]:  # the second prompt token's and the output token's: the whole vocabulary
        assert len(top) == vocab  # "token_id:N" keys (decoded strings would merge tokens that decode alike)
        # fp32 logprobs, each within a few ulps of its exact value: their probabilities sum to 1 within 1e-4
        assert math.isclose(math.fsum(math.exp(v) for v in top.values()), 1.0, rel_tol=1e-4)


def test_chat_top_logprobs_minus_one(app):
    vocab = app.state.async_engine.engine.model_config.vocab_size
    r = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                           "logprobs": True, "top_logprobs": -1, "temperature": 0})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 1 and len(content[0]["top_logprobs"]) == vocab


def test_max_logprobs_takes_minus_one_only():
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(device="cpu", max_model_len=64, max_logprobs=-2)
