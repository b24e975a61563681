"""The intake gate (on by default, REPLAYLLM_INTAKE_GATE, http/intake_gate.py): at a burst, requests that wait for the
tokenizer pool are handed off in arrival order instead of after every later arrival's intake; a place is given
back exactly once; only generation requests whose body is in are gated; the server answers as without it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
from fastapi.testclient import TestClient

from replayllm import LLM
from replayllm.entrypoints.http.intake_gate import DEFAULT_PLACES, ENV, IntakeGate, gate_from_env, gated, leave_intake
from replayllm.entrypoints.openai.api_server import build_app


def _burst(gate: IntakeGate | None, n: int = 6) -> list[tuple[str, int]]:
    """n requests arriving at once, each: its own checks, a wait for a pool thread (a text to encode), its
    hand-off; the order of events as the loop ran them."""
    events: list[tuple[str, int]] = []
    inside: list[int] = []

    async def request(k: int, loop, pool) -> None:
        if gate is not None:
            await gate.enter()
            inside.append(gate.inside)
        events.append(("checked", k))
        await loop.run_in_executor(pool, time.sleep, 0.01)
        events.append(("handed off", k))
        leave_intake()

    async def main():
        loop = asyncio.get_running_loop()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            await asyncio.gather(*(request(k, loop, pool) for k in range(n)))

    asyncio.run(main())
    assert gate is None or (max(inside) <= gate.permits and gate.inside == 0)
    return events


def test_without_a_gate_every_hand_off_waits_for_the_whole_burst():
    events = _burst(None)
    first_hand_off = events.index(("handed off", 0))
    assert all(("checked", k) in events[:first_hand_off] for k in range(6))


def test_with_a_gate_hand_offs_come_in_arrival_order_before_the_burst_is_checked():
    events = _burst(IntakeGate(2, 1 << 16))
    assert events.index(("handed off", 0)) < events.index(("checked", 5))  # the pool's answer did not wait
    assert [k for kind, k in events if kind == "checked"] == list(range(6))  # admitted in arrival order


def test_a_place_is_given_back_once_even_from_a_task_the_request_started():
    gate = IntakeGate(1, 1 << 16)

    async def child():
        leave_intake()

    async def main():
        await gate.enter()
        await asyncio.create_task(child())  # a task with a copy of the request's context gives it back...
        assert gate.inside == 0
        leave_intake()  # ... and the request's own, again: a no-op
        leave_intake()
        assert gate.inside == 0
        await asyncio.wait_for(gate.enter(), 5)  # the one place is free (not two: the semaphore is exact)
        assert gate._places.locked()
        leave_intake()

    asyncio.run(main())


class _Cycle:
    def __init__(self, more_body: bool):
        self.more_body = more_body

    async def send(self, message):
        pass


def _scope(method="POST", path="/v1/completions", length: bytes | None = b"100", root=""):
    headers = [(b"content-type", b"application/json")] + ([(b"content-length", length)] if length else [])
    return {"type": "http", "method": method, "path": root + path, "root_path": root, "headers": headers}


def test_only_generation_requests_whose_body_is_in_are_gated():
    done, uploading = _Cycle(False).send, _Cycle(True).send
    assert gated(_scope(), done, 1000)
    assert gated(_scope(path="/v1/chat/completions", root="/api"), done, 1000)  # behind --root-path
    assert not gated(_scope(), uploading, 1000)  # a slow upload never holds a place
    assert not gated(_scope(length=b"5000"), done, 1000)  # the tokenizer pool's large lane
    assert not gated(_scope(length=None), done, 1000)  # chunked: size unknown
    assert not gated(_scope(method="GET", path="/v1/models"), done, 1000)
    assert not gated(_scope(path="/tokenize"), done, 1000)


def test_the_gate_is_on_by_default_and_0_turns_it_off(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert gate_from_env(1000).permits == DEFAULT_PLACES == 8
    monkeypatch.setenv(ENV, "0")
    assert gate_from_env(1000) is None
    monkeypatch.setenv(ENV, "8")
    assert gate_from_env(1000).permits == 8
    monkeypatch.setenv(ENV, "many")
    with pytest.raises(ValueError, match=ENV):
        gate_from_env(1000)


def test_a_gated_server_answers_and_gives_every_place_back(monkeypatch):
    monkeypatch.setenv(ENV, "2")
    llm = LLM(device="cpu", dtype="float32", max_model_len=256)
    app = build_app(engine=llm.llm_engine)
    gate = app.state.intake_gate
    assert gate is not None and gate.permits == 2
    entered = []
    enter = gate.enter

    async def counting_enter():
        entered.append(1)
        await enter()

    gate.enter = counting_enter
    with TestClient(app) as client:
        for body in ({"prompt": "Once upon a time", "max_tokens": 3},
                     {"prompt": "Once upon a time", "max_tokens": 3, "stream": True},
                     {"prompt": [1, 2, 3], "max_tokens": 2},
                     {"prompt": "x", "max_tokens": -1},  # refused before the hand-off: its place comes back too
                     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = client.post(path, json=body)
            assert r.status_code == (400 if body["max_tokens"] < 0 else 200), r.text
            assert gate.inside == 0
        assert client.get("/v1/models").status_code == 200
    assert len(entered) == 5  # the five generation requests, not the model list
