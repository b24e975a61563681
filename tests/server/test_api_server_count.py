"""`replayllm serve --api-server-count N` (entrypoints/cli/api_workers.py): N API server processes over one
engine core. Two EngineCoreClients in this process over a real core (num_clients=2) show the routing and the
sleep state shared through the core deterministically (which process a connection lands on is the kernel's
choice); a real server with two processes shows the process handling (start, serve, stop, one dying)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from helpers.server_utils import ENGINE_ARGS, RemoteServer, alive, children

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.engine.core_client import EngineCoreClient
from replayllm.engine.core_watch import CoreAttachment
from replayllm.engine.request_stream import EngineAsleepError
from replayllm.entrypoints.cli.main import main as cli_main

DEADLINE_S = 60.0
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24], [31, 32]]


@pytest.fixture(scope="module")
def reference(tiny_models) -> list[list[int]]:
    """The offline engine's greedy tokens for PROMPTS (8 each)."""
    llm = LLM(tiny_models["qwen3"], device="cpu", dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def _generate(client: EngineCoreClient, request_id: str, prompts: list[list[int]]) -> list[list[int]]:
    stream = await client.add_requests(request_id, [{"prompt_token_ids": p} for p in prompts],
                                       [_greedy()] * len(prompts))
    final: dict[int, list[int]] = {}
    async for index, out in stream.outputs():
        if out.finished:
            final[index] = list(out.outputs[0].token_ids)
    return [final[i] for i in range(len(prompts))]


def test_two_clients_share_one_core_and_its_sleep(tiny_models, reference):
    config = EngineConfig(model=tiny_models["qwen3"], device="cpu", dtype="float32", max_model_len=256,
                          skip_tokenizer_init=True, enable_sleep_mode=True)
    first = EngineCoreClient(config, num_clients=2)
    first.start_core()

    async def scenario():
        first.start()
        attach = CoreAttachment(first.input_path, first.output_path, first.core_pid, first.snapshot.fields(), 1)
        second = EngineCoreClient(config, num_clients=2, attach=attach)
        second.start()
        try:
            assert second.snapshot.num_kv_blocks == first.snapshot.num_kv_blocks > 0
            # Both at once, with the same request ids (each process makes its own): each gets its own outputs.
            a, b = await asyncio.gather(_generate(first, "req", PROMPTS[:2]), _generate(second, "req2", PROMPTS[2:]))
            assert a + b == reference
            assert await first.call_utility("num_requests") == 0
            # One process puts the engine to sleep; the other's request is refused as asleep (a 503 over HTTP),
            # and its utility call gets its own answer.
            await first.sleep(1)
            assert await second.is_sleeping() is True
            with pytest.raises(EngineAsleepError):
                await _generate(second, "req3", PROMPTS[:1])
            # refused before a stream exists (the core's sleeping state reached the other process in its snapshot):
            # over HTTP a 503, never a started stream with an in-band error
            assert second.snapshot.sleeping == 1
            with pytest.raises(EngineAsleepError):
                await second.add_requests("req3b", [{"prompt_token_ids": PROMPTS[0]}], [_greedy()])
            await second.wake_up()  # the other one wakes it: the first one's requests run again
            assert await first.is_sleeping() is False
            assert await _generate(first, "req4", PROMPTS) == reference
        finally:
            second.close()
            await first.shutdown()

    asyncio.run(scenario())
    assert not alive(first.core_pid)


def _api_processes(server: RemoteServer) -> list[int]:
    """The server's spawned children: the engine core and the extra API server processes (multiprocessing's
    resource tracker, its other child, is not started through spawn_main)."""
    return [k for k in children(server.proc.pid) if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


def _wait_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while any(map(alive, pids)):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


async def _one(url: str, prompt: list[int], stream: bool) -> tuple[int, list[int]]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            "stream": stream}
    async with httpx.AsyncClient(timeout=DEADLINE_S) as c:  # a connection of its own: any process may take it
        if not stream:
            r = await c.post(url + "/completions", json=body)
            return r.status_code, r.json()["choices"][0]["token_ids"] if r.status_code == 200 else []
        tokens: list[int] = []
        async with c.stream("POST", url + "/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    tokens += httpx.Response(200, content=line[6:]).json()["choices"][0].get("token_ids") or []
        return r.status_code, tokens


def test_two_api_server_processes_serve_stop_and_fall_together(tiny_models, reference, tmp_path):
    server = RemoteServer([tiny_models["qwen3"], *ENGINE_ARGS, "--skip-tokenizer-init", "--api-server-count", "2"],
                          tmp_path)
    try:
        spawned = _api_processes(server)
        assert len(spawned) == 2, f"expected the engine core and one more API server process, got {spawned}"

        async def burst():
            jobs = [_one(server.base_url, PROMPTS[i % 4], stream=i % 2 == 0) for i in range(24)]
            return await asyncio.gather(*jobs)

        results = asyncio.run(burst())
        assert [s for s, _ in results] == [200] * 24
        assert [t for _, t in results] == [reference[i % 4] for i in range(24)]
        assert "2 API server processes" in server.log()
        # /metrics sums both processes (prometheus multiprocess mode), whichever one answers the scrape; the
        # engine's steps are counted once (by the first process), not once per process.
        for _ in range(6):  # each scrape on a connection of its own
            m = server.metrics()
            assert m["replayllm:requests_added_total"] == 24
            assert m["replayllm:generation_tokens_total"] == 24 * 8
            assert m['replayllm:http_requests_total{route="/v1/completions",status="200"}'] == 24
            assert m["replayllm:request_generation_tokens_count"] == 24
        # The extra process dies: the server stops (non-zero), the engine core with it.
        worker = max(spawned)  # spawned after the core
        os.kill(worker, signal.SIGKILL)
        server.proc.wait(timeout=DEADLINE_S)
        assert server.proc.returncode not in (0, None)
        assert "API server process replayllm-api-server-1" in server.log()
        assert "error: an API server process died; the server stopped" in server.log()
        _wait_gone(spawned, "the engine core outlived the server")
    finally:
        server.stop()


def test_sigterm_stops_every_api_server_process(tiny_models, tmp_path):
    server = RemoteServer([tiny_models["qwen3"], *ENGINE_ARGS, "--skip-tokenizer-init", "--api-server-count", "3"],
                          tmp_path)
    try:
        kids = children(server.proc.pid)
        assert len(_api_processes(server)) == 3  # the core and two more API servers
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=DEADLINE_S)
        assert server.proc.returncode in (0, -signal.SIGTERM)
        _wait_gone(kids, "a child process outlived the server")
    finally:
        server.stop()


def test_api_server_count_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["serve", "--api-server-count", "0"])
    assert e.value.code == 2 and "api-server-count" in capsys.readouterr().err


def test_metrics_folder_only_for_several_processes_and_never_over_the_users(monkeypatch, tmp_path):
    from replayllm.entrypoints.http import multiprocess_metrics as mm

    monkeypatch.delenv(mm.ENV, raising=False)
    assert mm.enable(1) is None and not mm.active()
    folder = mm.enable(2)
    assert folder is not None and os.path.isdir(folder) and os.environ[mm.ENV] == folder and mm.active()
    mm.cleanup(folder)
    assert not os.path.exists(folder) and mm.ENV not in os.environ
    monkeypatch.setenv(mm.ENV, str(tmp_path))  # the user's own: used as it is, never removed
    assert mm.enable(4) is None and os.environ[mm.ENV] == str(tmp_path)
