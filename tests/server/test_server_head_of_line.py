"""Head-of-line blocking (issue 15): big inputs are tokenized, templated and parsed on the tokenizer pool, so the
streams already decoding keep their pace (longest gap between chunks <= 2x a baseline measured here, with a
1 s floor for a busy CI box) and a small request's first token is not held up by a big tokenization.
The streams are read by a process of their own (tests/helpers/stream_watcher.py): this one sends megabytes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers.server_utils import ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.serial  # stream gaps compared with a baseline: `make test` runs it alone

MODEL = "replayllm/tiny-qwen3"
K = 3  # concurrent streams whose gaps are watched
STREAM = {"model": MODEL, "prompt": [12522, 5193, 264, 882], "max_tokens": 400, "ignore_eos": True,
          "temperature": 0, "stream": True}
FIVE_MB = "Once upon a time there lived a fox. " * (5 * 1024 * 1024 // 36)
JSON = {"Content-Type": "application/json"}
TIMEOUT_S = 300.0  # every wait is bounded, generously (5 MB takes 3-5 s to tokenize alone, 30-45 s on a
# 2-core machine loaded 4x over by other jobs)


def bound(baseline: float) -> float:
    """The issue's "<= 2x normal", with a floor so scheduling noise on a busy machine cannot fail it: on 2 cores
    kept at load ~9 by other jobs, gaps of 0.6-0.8 s came and went with nothing blocking (the freezes this
    guards against were 6.7-8 s)."""
    return max(2 * baseline, baseline + 1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Limits raised so the big inputs are really tokenized (the defaults would refuse most of them up front).
    srv = RemoteServer([*ENGINE_ARGS, "--max-prompt-chars", "6000000", "--max-bad-words", "10000",
                        "--tokenizer-pool-queue", "1"], tmp_path_factory.mktemp("hol"))
    yield srv
    srv.stop()


class Streams:
    """K streams decoding back to back in a watcher process (tests/helpers/stream_watcher.py); the chunk arrival
    times of each stream, read from its output by a thread."""

    def __init__(self, server: RemoteServer):
        watcher = Path(__file__).parents[1] / "helpers" / "stream_watcher.py"
        self.proc = subprocess.Popen([sys.executable, str(watcher), server.base_url + "/completions", str(K),
                                      json.dumps(STREAM)], stdout=subprocess.PIPE, text=True)
        self.runs: dict[str, list[float]] = {}  # one list of chunk times per stream
        self.errors: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            run, t = line.split()
            if run == "error":
                self.errors.append(t)
            else:
                self.runs.setdefault(run, []).append(float(t))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(TIMEOUT_S)

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest time between two consecutive chunks of one stream, over gaps touching [t0, t1]."""
        gaps = [b - a for run in list(self.runs.values()) for a, b in zip(run[1:], run[2:]) if b >= t0 and a <= t1]
        assert gaps, "no stream produced chunks around the scenario"
        return max(gaps)

    async def chunk_after(self, t: float) -> None:
        """Until every watched stream position has a chunk after t (a gap still open at t1 is then closed)."""
        deadline = time.monotonic() + TIMEOUT_S
        while sum(run[-1] > t for run in list(self.runs.values())) < K:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the streams stopped"
            await asyncio.sleep(0.05)


async def _first_token_s(client: httpx.AsyncClient, server: RemoteServer) -> float:
    """Seconds from sending a small streaming request to its first token."""
    t0 = time.monotonic()
    async with client.stream("POST", server.base_url + "/completions",
                             json={**STREAM, "prompt": "Hello there", "max_tokens": 2}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise AssertionError("no token")


def _scenarios():
    words = [f"w{i}x" for i in range(10_000)]  # 10k bad words: 20k encodes, ~60k characters
    messages = [{"role": "user", "content": f"message {i}"} for i in range(100_000)]
    return [
        ("10k bad_words", "/v1/completions",
         {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "bad_words": words}, 200),
        ("100k chat messages: parsed, then refused by --max-chat-messages", "/v1/chat/completions",
         {"model": MODEL, "messages": messages, "max_tokens": 1}, 400),
        # 1 MB, not 5: a /tokenize answer lists every id, and making 1.3M Python ints is one C call holding the
        # GIL (~0.1 s on a quiet machine, up to 0.6 s on a loaded one; docs/serving.md)
        ("1 MB /tokenize (270k ids)", "/tokenize", {"prompt": FIVE_MB[:1024 * 1024]}, 200),
    ]


def test_big_inputs_do_not_stall_other_streams(server):
    # Bodies encoded before the streams start: a 5 MB json.dumps in this loop would stall the streams' reader.
    scenarios = [(name, path, json.dumps(body).encode(), status) for name, path, body, status in _scenarios()]
    five_mb = json.dumps({"model": MODEL, "prompt": FIVE_MB, "max_tokens": 1}).encode()

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            await streams.chunk_after(time.monotonic() + 1.0)  # every stream is past its first token
            t0 = time.monotonic()
            await asyncio.sleep(3.0)
            baseline_ttft = min([await _first_token_s(client, server) for _ in range(3)])
            baseline = streams.longest_gap(t0, time.monotonic())
            # A 5 MB prompt (tokenized, then refused: longer than max_model_len); meanwhile a small request gets
            # its first token as fast as before.
            t0 = time.monotonic()
            big = asyncio.create_task(client.post(server.base_url + "/completions", content=five_mb, headers=JSON))
            await asyncio.sleep(0.5)  # the body is sent and the tokenization under way
            ttft = await _first_token_s(client, server)
            assert not big.done(), "the 5 MB tokenization ended before the small request (no overlap to test)"
            r = await big
            t1 = time.monotonic()
            await streams.chunk_after(t1)
            results = [("5 MB prompt", r, 400, streams.longest_gap(t0, t1))]
            for name, path, content, status in scenarios:
                t0 = time.monotonic()
                r = await client.post(server.url + path, content=content, headers=JSON)
                t1 = time.monotonic()
                await streams.chunk_after(t1)
                results.append((name, r, status, streams.longest_gap(t0, t1)))
            return baseline, baseline_ttft, ttft, results

    streams = Streams(server)
    try:
        baseline, baseline_ttft, ttft, results = asyncio.run(scenario())
    finally:
        streams.stop()
    gaps = {name: round(gap, 3) for name, _, _, gap in results}
    for name, r, status, gap in results:
        assert r.status_code == status, (name, r.text[:500])
        assert len(r.content) < 4096 or status == 200, (name, "error body not bounded")
        assert gap <= bound(baseline), f"{name}: a stream's longest gap {gap:.3f}s > bound({baseline:.3f}s); " \
                                       f"all: {gaps}"
    assert "longer than max_model_len" in results[0][1].json()["error"]["message"]
    assert results[-1][1].json()["count"] > 200_000  # the text really was tokenized
    assert ttft <= bound(baseline_ttft), f"first token {ttft:.3f}s behind a big tokenization (alone: " \
                                         f"{baseline_ttft:.3f}s)"


def test_large_lane_full_is_a_503(server):
    """--tokenizer-pool-queue 1: a second large input while one is tokenized is refused at once, not queued."""
    text = FIVE_MB[:1024 * 1024]

    async def scenario():
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
            return await asyncio.gather(*[client.post(server.url + "/tokenize", json={"prompt": text})
                                          for _ in range(2)])

    responses = sorted(asyncio.run(scenario()), key=lambda r: r.status_code)
    assert [r.status_code for r in responses] == [200, 503], [r.text[:300] for r in responses]
    busy = responses[1]
    assert busy.json()["error"]["code"] == "server_busy"
    assert "--tokenizer-pool-queue" in busy.json()["error"]["message"]
    assert busy.headers["retry-after"] == "1"
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).status_code == 200
