"""Structured outputs over HTTP (a real `replayllm serve` subprocess, the engine core in its own process):
response_format json_schema / json_object on chat and completions, vLLM's structured_outputs field."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from helpers.server_utils import ENGINE_ARGS, RemoteServer

pytest.importorskip("xgrammar")  # a dependency; the GPU machine has it only when its wheels travel in .whl/
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "rank": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
    "required": ["city", "rank"],
}
NUM = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer([*ENGINE_ARGS, "--max-num-seqs", "32"], tmp_path_factory.mktemp("server_structured"))
    yield srv
    srv.stop()


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=300.0)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_response_format_json_schema(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    body = {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 64, "n": NUM - 4,
            "temperature": 1.0, "seed": 5, "response_format": fmt,
            "structured_outputs": {"disable_any_whitespace": True}}  # vLLM: options next to response_format
    choices = _post(server, "/v1/chat/completions", body)["choices"]
    assert len(choices) == NUM - 4
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    # The same on /v1/completions, greedy: NUM JSON outputs over HTTP in all.
    body = {"prompt": [f"City {i}:" for i in range(4)], "max_tokens": 64, "temperature": 0,
            "response_format": fmt, "structured_outputs": {"disable_any_whitespace": True}}
    for c in _post(server, "/v1/completions", body)["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), SCHEMA)


def test_completions_structured_outputs_choice_and_regex(server):
    choice = ["red", "green", "blue"]
    body = {"prompt": [f"Colour {i}:" for i in range(NUM)], "max_tokens": 16, "temperature": 1.0, "seed": 2,
            "structured_outputs": {"choice": choice}}
    texts = [c["text"] for c in _post(server, "/v1/completions", body)["choices"]]
    assert len(texts) == NUM and all(t in choice for t in texts)
    body = {"prompt": "Code:", "max_tokens": 16, "temperature": 0, "structured_outputs": {"regex": r"[A-F]{2}-\d{3}"}}
    assert re.fullmatch(r"[A-F]{2}-\d{3}", _post(server, "/v1/completions", body)["choices"][0]["text"])


def test_completions_response_format_json_object_streamed(server):
    body = {"prompt": "JSON:", "max_tokens": 48, "temperature": 0, "stream": True,
            "response_format": {"type": "json_object"}}
    text, finish = "", None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300.0) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert text.lstrip().startswith("{")
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    server.wait_idle(timeout=60.0)


def test_async_scheduling_server_structured_equals_offline_and_frees_on_disconnect(tmp_path):
    """`serve --async-scheduling`: the engine core fills step N+1's bits on its fill thread while it makes step
    N's outputs and schedules N+2 ahead. Concurrent schema requests give the offline engine's texts; a structured
    stream whose client goes away mid-way is aborted (possibly while it sits in a step scheduled ahead) and every
    KV block comes back."""
    from replayllm import LLM, SamplingParams, StructuredOutputsParams

    srv = RemoteServer([*ENGINE_ARGS, "--max-num-seqs", "32", "--async-scheduling"], tmp_path)
    try:
        spec = {"json": SCHEMA, "disable_any_whitespace": True}
        bodies = [{"prompt": f"City {i}:", "max_tokens": 40, "temperature": 0, "structured_outputs": spec}
                  for i in range(8)]
        ref = LLM(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=32)
        expected = ref.generate([b["prompt"] for b in bodies],
                                SamplingParams(temperature=0, max_tokens=40,
                                               structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
        for r, exp in zip(srv.post_all("/completions", bodies), expected):
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (exp.outputs[0].text, exp.outputs[0].finish_reason)
        body = {"prompt": "JSON:", "max_tokens": 400, "temperature": 0, "stream": True,
                "response_format": {"type": "json_object"}}
        with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=300.0) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: {")
                if events >= 5:
                    break  # the client goes away mid-stream
        srv.wait_idle(timeout=60.0)
    finally:
        srv.stop()
