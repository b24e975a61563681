"""`replayllm bench serve`'s reading of a streamed response (`Arrivals`): token chunks in compact JSON are timed
without a parse, and every payload gives the same TTFT, gaps, token count and errors as parsing all of them."""

from __future__ import annotations

import json

import pytest

from replayllm.entrypoints.bench.serve import Arrivals, RequestResult


def _chunk(text: str, **extra) -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}], **extra}
    return json.dumps(body, separators=(",", ":")).encode()


USAGE = json.dumps({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                             "total_tokens": 7}}, separators=(",", ":")).encode()
TRICKY = _chunk('say "choices":[{ and "usage":{ here')  # the markers inside a string: escaped quotes


def _read(payloads: list[bytes], parse_all: bool) -> tuple[RequestResult, list[bool]]:
    result = RequestResult()
    arrivals = Arrivals(result, start=0.0)
    if parse_all:  # the reference: every payload through json (what the fast path must equal)
        arrivals.take = lambda p, now, _take=arrivals.take: _take(p.replace(b":", b": "), now)
    kept = []
    for k, p in enumerate(payloads):  # as the client: the stream's reading ends at [DONE] or an error
        kept.append(arrivals.take(p, float(k + 1)))
        if not kept[-1]:
            break
    return result, kept


@pytest.mark.parametrize("payloads", [
    [_chunk("a"), _chunk(" b"), TRICKY, _chunk("", usage=None), USAGE, b"[DONE]"],
    [_chunk("a", usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}), b"[DONE]"],
    [_chunk("a"), json.dumps({"error": {"message": "boom", "code": 500}}).encode(), _chunk("b")],
])
def test_the_fast_path_reads_what_a_full_parse_reads(payloads):
    fast, fast_kept = _read(payloads, parse_all=False)
    full, full_kept = _read(payloads, parse_all=True)
    assert fast == full and fast_kept == full_kept
    assert fast.ttft == 1.0 and fast.itl == [1.0] * (len(fast.itl))


def test_tokens_usage_and_errors_are_read():
    result, kept = _read([_chunk("a"), _chunk(" b"), TRICKY, USAGE, b"[DONE]"], parse_all=False)
    assert (result.ttft, result.itl, result.output_tokens, result.error) == (1.0, [1.0, 1.0], 4, "")
    assert kept == [True, True, True, True, False]
    result, kept = _read([_chunk("a"), json.dumps({"error": {"message": "boom"}}).encode()], parse_all=False)
    assert result.error == "boom" and kept == [True, False]


def test_burstiness_gives_gamma_gaps_of_the_rate_and_metadata_reaches_the_json(monkeypatch):
    """vLLM's --burstiness: gamma gaps of that shape whose mean is 1 / rate (1: the exponential gaps as before);
    --metadata KEY=VALUE pairs go into the result JSON; a bad value of either is refused before any request."""
    import argparse
    import asyncio
    import random
    import statistics

    from replayllm.entrypoints.bench import serve

    gaps = []

    async def record(seconds):
        gaps.append(seconds)

    monkeypatch.setattr(serve.asyncio, "sleep", record)

    async def drain(burstiness):
        gaps.clear()
        async for _ in serve._arrivals(4001, 10.0, random.Random(0), burstiness):
            pass
        return list(gaps)

    even, bursty = asyncio.run(drain(20.0)), asyncio.run(drain(0.2))
    rng = random.Random(0)
    assert asyncio.run(drain(1.0)) == [rng.expovariate(10.0) for _ in range(4001)]  # Poisson, as before
    for g in (even, bursty):
        assert abs(statistics.mean(g) - 0.1) < 0.01  # the rate holds whatever the shape
    assert statistics.pstdev(even) < 0.05 < 0.1 < statistics.pstdev(bursty)  # cv = 1 / sqrt(shape)
    args = argparse.Namespace(metadata=["gpu=h200", "note=a=b"])
    assert serve.metadata(args) == {"gpu": "h200", "note": "a=b"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        serve.metadata(argparse.Namespace(metadata=["oops"]))
