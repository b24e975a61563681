"""Many streams at once through `replayllm serve` (chunks written by the output router): offline-equal pieces,
a client that does not read, a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

MODEL = "replayllm/tiny-qwen3"
DEADLINE_S = 120.0  # generous: a loaded 2-core CI machine
PROMPTS = [[12522, 5193, 264, 882, 100 + i] for i in range(4)]
TRACES = [[(7 * i + 13 * j) % 5000 + 200 for j in range(16)] for i in range(4)]
SLOW_TRACE = [(31 * j) % 5000 + 200 for j in range(250)]  # ~140 kB of chunks (top-5 logprobs)


@pytest.fixture(scope="module")
def server(shared_open_trace_server):
    return shared_open_trace_server


@pytest.fixture(autouse=True)
def idle_after_each_test(server):
    """Every test leaves nothing running and every KV block free (a leaked request would hold blocks)."""
    yield
    server.wait_idle(timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def offline():
    llm = LLM(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=512)
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=2) for t in TRACES]
    params.append(SamplingParams(trace_decode_token_ids=SLOW_TRACE, logprobs=5))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS + [PROMPTS[0]]], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _body(prompt, trace, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "trace_decode_token_ids": trace, "trace_replay_chunk_size": 1,
            "logprobs": 2, "return_token_ids": True, "stream": True, **extra}


def _events(raw: bytes) -> list:
    """The SSE events of a body: dicts, then the literal "[DONE]" last."""
    return [e[6:] if e == b"data: [DONE]" else json.loads(e[6:]) for e in raw.split(b"\n\n") if e]


def _assert_equals_offline(events: list, ref) -> None:
    assert events[-1] == b"[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == len(ref.token_ids)
    choices = [e["choices"][0] for e in events[:-2]]
    assert [t for c in choices for t in c["token_ids"]] == ref.token_ids
    assert "".join(c["text"] for c in choices) == ref.text
    got = [x for c in choices for x in c["logprobs"]["token_logprobs"]]
    # Concurrent streams vs one offline batch: other batch compositions, another summation order.
    want = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)]
    assert got == pytest.approx(want, abs=LOGPROB_TOL, rel=0)
    assert choices[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in choices[:-1])


def _dechunk(raw: bytes) -> tuple[bytes, bool]:
    """An HTTP/1.1 chunked body's data, and whether its last (empty) chunk arrived."""
    body, pos = bytearray(), 0
    while True:
        end = raw.find(b"\r\n", pos)
        if end == -1:
            return bytes(body), False
        size = int(raw[pos:end], 16)
        if size == 0:
            return bytes(body), True
        body += raw[end + 2:end + 2 + size]
        pos = end + 4 + size


def _slow_client(server) -> socket.socket:
    """A streaming request sent on a socket with a tiny receive buffer that nobody reads yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(_body(PROMPTS[0], SLOW_TRACE, logprobs=5, stream_options={"include_usage": True})).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(DEADLINE_S)
    raw = bytearray()
    while True:
        data = sock.recv(1 << 16)
        raw += data
        head_end = raw.find(b"\r\n\r\n")
        if not data or (head_end != -1 and _dechunk(bytes(raw[head_end + 4:]))[1]):
            break
    head, _, rest = bytes(raw).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    body, complete = _dechunk(rest)
    assert complete
    return body


def test_concurrent_streams_equal_offline_while_a_client_does_not_read(server, offline):
    """Four streams (one token per step) run to the end while a fifth client reads nothing: its transport
    backs up (the output router then leaves it to its queued path) without stalling the others, and it
    still gets every chunk, in order, once it reads."""
    slow = _slow_client(server)
    try:
        async def all_at_once():
            async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
                async def one(p, t):
                    async with c.stream("POST", server.base_url + "/completions", json=_body(
                            p, t, stream_options={"include_usage": True})) as r:
                        assert r.status_code == 200
                        return await r.aread()
                return await asyncio.gather(*(one(p, t) for p, t in zip(PROMPTS, TRACES)))

        for raw, ref in zip(asyncio.run(all_at_once()), offline):
            _assert_equals_offline(_events(raw), ref)
        _assert_equals_offline(_events(_read_all(slow)), offline[-1])
    finally:
        slow.close()


def test_client_leaving_mid_stream_frees_its_request_while_others_stream(server, offline):
    async def scenario():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as c:
            async def leaves():
                async with c.stream("POST", server.base_url + "/completions",
                                    json=_body(PROMPTS[0], SLOW_TRACE)) as r:
                    events = 0
                    async for line in r.aiter_lines():
                        events += line.startswith("data: {")
                        if events == 5:
                            return events  # closes the connection mid-stream

            async def stays(p, t):
                async with c.stream("POST", server.base_url + "/completions",
                                    json=_body(p, t, stream_options={"include_usage": True})) as r:
                    return await r.aread()
            return await asyncio.gather(leaves(), *(stays(p, t) for p, t in zip(PROMPTS[1:3], TRACES[1:3])))

    left, *raws = asyncio.run(scenario())
    assert left == 5
    for raw, ref in zip(raws, offline[1:3]):
        _assert_equals_offline(_events(raw), ref)
    deadline = time.monotonic() + DEADLINE_S
    while server.metrics().get('replayllm:requests_finished_total{finished_reason="abort"}', 0.0) < 1:
        assert time.monotonic() < deadline, "the request of the client that left was not aborted"
        time.sleep(0.1)
