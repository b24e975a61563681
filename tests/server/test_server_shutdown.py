"""SIGTERM on `replayllm serve` while streams decode, a non-streaming request waits and a 20 MB text is being
tokenized (issue 15): every client gets an error JSON or an SSE error event (or its finished output), and the
whole process tree is gone within 10 s (the product requirement: not loosened for a busy machine)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from helpers.server_utils import RemoteServer, alive, children

pytestmark = pytest.mark.serial  # exit within 10 s of SIGTERM: `make test` runs it alone

MODEL = "replayllm/tiny-qwen3"
EXIT_S = 10.0  # the bound, from SIGTERM to the last process of the tree gone
TIMEOUT_S = 120.0  # client waits (generous: a loaded 2-core CI machine)
LONG = {"model": MODEL, "prompt": [12522, 5193, 264, 882], "max_tokens": 2000, "ignore_eos": True,
        "temperature": 0}
TWENTY_MB = json.dumps({"prompt": "Once upon a time there lived a fox. " * (20 * 1024 * 1024 // 36)}).encode()


async def _stream(server: RemoteServer, client: httpx.AsyncClient, started: asyncio.Event) -> list:
    events: list = []
    async with client.stream("POST", server.base_url + "/completions", json={**LONG, "stream": True}) as r:
        events.append(r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) > 3:
                    started.set()
    return events


def _is_error_or_finished(event: str) -> bool:
    body = json.loads(event)
    if "error" in body:
        return body["error"]["code"] == "engine_unavailable" and "shutting down" in body["error"]["message"]
    return body["choices"][0]["finish_reason"] is not None


def test_sigterm_fails_every_client_and_exits_within_10_s(tmp_path):
    server = RemoteServer(["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
                           "--max-prompt-chars", "25000000"], tmp_path)
    try:
        tree = [server.proc.pid, *children(server.proc.pid)]  # the server, its engine core, the resource tracker

        async def scenario():
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                started = [asyncio.Event() for _ in range(3)]
                streams = [asyncio.create_task(_stream(server, client, s)) for s in started]
                plain = asyncio.create_task(client.post(server.base_url + "/completions", json=LONG))
                big = asyncio.create_task(client.post(server.url + "/tokenize", content=TWENTY_MB,
                                                      headers={"Content-Type": "application/json"}))
                for s in started:
                    await asyncio.wait_for(s.wait(), TIMEOUT_S)
                await asyncio.sleep(2.0)  # the 20 MB body is in and being tokenized (~1 s per MB)
                assert not big.done(), big.result().text[:300]
                sent = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                results = await asyncio.wait_for(asyncio.gather(*streams, plain, big), TIMEOUT_S)
                return sent, results

        sent, results = asyncio.run(scenario())
        while any(map(alive, tree)) and time.monotonic() - sent < 60:  # poll; the bound is asserted below
            time.sleep(0.05)
        gone_s = time.monotonic() - sent
        *streams, plain, big = results
        for events in streams:
            assert events[0] == 200 and events[-1] == "[DONE]", events[-3:]
            assert _is_error_or_finished(events[-2]), events[-2]
        assert any("error" in json.loads(events[-2]) for events in streams)  # 2000 tokens: still running
        assert plain.status_code in (200, 503), plain.text[:300]
        if plain.status_code == 503:
            assert plain.json()["error"]["code"] == "engine_unavailable"
        assert big.status_code == 503, big.text[:300]  # 20 MB is ~20 s of tokenizing: failed, not waited for
        assert big.headers["content-type"] == "application/json"
        assert "shutting down" in big.json()["error"]["message"]
        assert gone_s < EXIT_S, f"the process tree took {gone_s:.1f}s to exit:\n{server.log()[-3000:]}"
    finally:
        server.stop()
