"""HTTP hardening against an in-process app (issue 31): bodies nested too deep (small and large), lone surrogates
in `model` and in field names, capped accepted-and-ignored fields, the chunked 413's text, and the API process's
RSS after many large requests (freed heap handed back). Plus the depth scanner on its own."""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest
from starlette.testclient import TestClient

from replayllm.config import EngineConfig
from replayllm.entrypoints.http.heap_trim import LARGE_BODY, TRIMMER
from replayllm.entrypoints.http.limits import RequestLimits
from replayllm.entrypoints.openai.api_server import build_app
from replayllm.json_depth import NestedTooDeep, check, exceeds, too_deep_key, value_exceeds
from replayllm.structured_outputs import StructuredOutputsParams

BODY_LIMIT = 8_000_000
DEPTH = RequestLimits().max_json_depth  # the default, 128
OK = {"prompt": "hi", "max_tokens": 2}
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client():
    app = build_app(EngineConfig(device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4, seed=0),
                    limits=RequestLimits(max_request_body_bytes=BODY_LIMIT, max_prompt_chars=BODY_LIMIT))
    app.state.async_engine.start()
    try:
        yield TestClient(app)  # no lifespan: the engine loop is started here
    finally:
        app.state.async_engine.stop()


def post(client, body: bytes, path: str = "/v1/completions"):
    return client.post(path, content=body, headers=HEADERS)


def error(r, status: int, param, code, part: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert part in err["message"], err
    return err


def schema(levels: int) -> str:
    """A JSON schema nesting 2 * levels + 1 levels: {"type": "object", "properties": {"a": ...}} inside each other."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


# --- nesting depth -------------------------------------------------------------------------------------------

def test_deep_small_body_is_a_400_naming_the_field(client):
    """12.6 KB, a json_schema nested 500 levels: was a 500 (RecursionError in copy.deepcopy)."""
    body = ('{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": '
            '{"name": "x", "schema": ' + schema(250) + "}}}").encode()
    assert len(body) < LARGE_BODY
    error(post(client, body), 400, "response_format", "limit_exceeded", f"more than {DEPTH} levels")


def test_deep_large_body_is_a_400_naming_the_field(client):
    """Over 64 KiB (parsed on the tokenizer pool after the helper process looked at it), nested 2,000 levels:
    was a 500 in the parser."""
    body = ('{"prompt": "' + "x" * LARGE_BODY + '", "structured_outputs": {"json": ' + "[" * 2000 + "]" * 2000
            + "}}").encode()
    error(post(client, body), 400, "structured_outputs", "limit_exceeded", "--max-json-depth")
    body = b"[" * 100_000 + b"]" * 100_000  # not an object at all: no field to name
    error(post(client, body), 400, None, "limit_exceeded", "the request body nests")


def test_depth_at_the_limit_is_accepted(client):
    """The body's object is level 1: chat_template_kwargs' value at levels 3 .. DEPTH is fine (and copied,
    rendered, logged without running out of stack); one level more is the 400. Brackets in strings do not count."""
    for size in (0, LARGE_BODY):  # FastAPI's path and the pool's
        value = '{"a": ' * (DEPTH - 2) + "1" + "}" * (DEPTH - 2)
        body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": ["' + "[{" * 500
                + "x" * size + '"], "chat_template_kwargs": {"v": ' + value + "}}").encode()
        r = post(client, body, "/v1/chat/completions")
        assert r.status_code == 200, r.text
        deeper = body.replace(b'{"v": ', b'{"v": [', 1).replace(b"}}", b"]}}", 1)
        error(post(client, deeper, "/v1/chat/completions"), 400, "chat_template_kwargs", "limit_exceeded")


def test_deep_schema_inside_a_string_or_a_dict_is_refused(client):
    """A schema given as JSON text hides its nesting from the body's depth check: StructuredOutputsParams checks
    it (was a 500: RecursionError in json.loads), and a dict from the Python API (was one in copy.deepcopy)."""
    for text in ("[" * 5000 + "]" * 5000, '{"a": ' * 300 + "1" + "}" * 300):
        r = post(client, json.dumps({**OK, "structured_outputs": {"json": text}}).encode())
        error(r, 400, "structured_outputs", None, f"more than {DEPTH} levels")
    deep: dict = {"type": "string"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match="structured_outputs.json nests"):
        StructuredOutputsParams(json=deep)
    assert value_exceeds(deep, 4000) and not value_exceeds(deep, 4001) and not value_exceeds([], 1)


def test_depth_scanner():
    assert not exceeds(b'{"a": "[[[[[[[[", "b": [[1]]}', 3)  # brackets in strings do not count
    assert not exceeds(b'{"a": "\\"[[[[[[[[", "b": [[1]]}', 3)  # nor after an escaped quote
    assert exceeds(b'{"a": 1, "b\\u00e9": [[[1]]]}', 3)
    assert too_deep_key(b'{"a": 1, "b\\u00e9": [[[1]]]}', 3) == (True, "b\u00e9")
    assert too_deep_key(b'[[[[1]]]]', 3) == (True, None)
    assert not exceeds(b"[[]]" * 1000 + b"[", 3)  # unbalanced but shallow: the parser's error, not ours
    with pytest.raises(NestedTooDeep, match="'k' nests arrays/objects more than 2 levels"):
        check(b'{"k": [[1]], "z": 1}', 2)
    check(b'{"k": [1], "z": [2]}', 2)
    # An unterminated string full of escaped quotes: linear, not quadratic (~0.1 s for 4 MB either way it
    # runs; a backtracking scan would take hours).
    evil = b'[' * 200 + b'"' + b'\\"' * 2_000_000
    assert too_deep_key(evil, 100) == (True, None) and not exceeds(evil[200:], 100)


# --- Unicode, ignored fields, 413 ------------------------------------------------------------------------------

def test_lone_surrogates_in_model_and_field_names_are_400s(client):
    error(post(client, b'{"prompt": "hi", "max_tokens": 2, "model": "\\ud800"}'), 400, "model", "invalid_unicode",
          "U+D800")
    err = error(post(client, b'{"prompt": "hi", "max_tokens": 2, "\\udc00x": 1}'), 400, "\\udc00x",
                "invalid_unicode", "field name")
    assert "U+DC00" in err["message"]
    error(post(client, b'{"prompt": "hi", "stream_options": {"\\ud800": true}, "stream": true}'), 400,
          "stream_options.\\ud800", "invalid_unicode", "in stream_options")


@pytest.mark.parametrize("field, value, param", [
    ("user", "u" * 257, "user"),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata"),
    ("metadata", {"k" * 65: "v"}, "metadata." + "k" * 65),
    ("metadata", {"k": "v" * 513}, "metadata.k"),
    ("user", "u" * 5_000_000, "user"),  # took 5 MB of memory per request before
])
def test_ignored_fields_are_capped(client, field, value, param):
    r = post(client, json.dumps({**OK, field: value}).encode())
    error(r, 400, param, None)
    assert len(r.content) < 2048


def test_ignored_fields_at_their_caps_are_accepted(client):
    body = {**OK, "user": "u" * 256, "metadata": {"k" * 64: "v" * 512, **{f"k{i}": "v" for i in range(15)}}}
    r = post(client, json.dumps(body).encode())
    assert r.status_code == 200, r.text


def test_chunked_413_reads_like_the_content_length_one(client):
    def chunks():
        for _ in range(BODY_LIMIT // 1_000_000 + 1):
            yield b" " * 1_000_000

    err = error(client.post("/v1/completions", content=chunks(), headers=HEADERS), 413, None, "request_too_large")
    assert err["message"] == (f"the request body is too large: more than {BODY_LIMIT} bytes (sent without "
                              f"Content-Length); this server accepts at most {BODY_LIMIT} bytes "
                              "(--max-request-body-bytes)")
    declared = error(post(client, b" " * (BODY_LIMIT + 1)), 413, None, "request_too_large")["message"]
    assert declared.replace(str(BODY_LIMIT + 1), "N") == err["message"].replace(
        f"more than {BODY_LIMIT} bytes (sent without Content-Length)", "N bytes")


# --- RSS ---------------------------------------------------------------------------------------------------

def _rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


@pytest.mark.skipif(not (TRIMMER.available and os.path.exists("/proc/self/clear_refs")),
                    reason="needs glibc's malloc_trim and Linux's /proc (peak RSS reset)")
def test_rss_after_many_large_prompts_stays_within_one_prompts_footprint(client, monkeypatch):
    """Each 0.5 MB prompt is tokenized (~92k tokens) and refused (longer than max_model_len). What that freed stayed
    with the process (567 -> 2,418 MiB over 9 x 5 MB prompts): the tokenizer pool's error cycles kept each job's
    frames (prompt, ids) until a full GC, idle workers kept their last job, and glibc kept the freed pages in its
    arenas. Now the growth over 5 prompts stays below what ONE prompt needs at its peak (its high-water mark
    over the RSS before it), not 5 times it."""
    monkeypatch.setattr(TRIMMER, "min_interval", 0.05)  # a trim after every request (not one a second)
    words = "the quick brown fox jumps over lazy dogs while seven wizards box".split()

    async def ask(http, i: int) -> None:
        text = " ".join(random.Random(i).choices(words, k=110_000))[:500_000]
        r = await http.post("/v1/completions", content=json.dumps({"prompt": text, "max_tokens": 2}).encode(),
                            headers=HEADERS)
        assert r.status_code == 400 and "longer than max_model_len" in r.text, r.text
        assert TRIMMER.wait_idle(30)

    async def run() -> tuple[float, float]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://t",
                                     timeout=60) as http:
            await ask(http, 0)  # warm: the tokenizer pool's threads and arenas exist
            before = _rss_mib()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            await ask(http, 1)
            footprint = _rss_mib("VmHWM") - before
            for i in range(2, 6):
                await ask(http, i)
            return _rss_mib() - before, footprint

    growth, footprint = asyncio.run(run())
    assert growth < footprint, (growth, footprint)
