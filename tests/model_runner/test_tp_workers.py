"""The tensor-parallel worker processes' lifecycle on CPU (gloo, model_runner_v2/tp_workers.py): sizes the model
cannot split are refused before any worker starts; a collected engine stops its workers; a worker killed
mid-step or failing makes the step raise (no hang) and leaves no process behind. The numbers under TP=2:
test_tensor_parallel.py."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest

from replayllm import LLM, SamplingParams


def _engine_kwargs(**extra) -> dict:
    return dict(device="cpu", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                enable_trace_replay=True, seed=0, **extra)


def test_bad_tensor_parallel_sizes_are_rejected(tiny_models):
    with pytest.raises(ValueError, match="num_key_value_heads=1"):  # llama: one KV head cannot be split
        LLM(tiny_models["llama"], **_engine_kwargs(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=3))
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=bad))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]


def test_collected_engine_stops_its_workers(tiny_models):
    llm = LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=2))
    procs = [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]
    assert [p.pid for p in procs] == llm.llm_engine.runner.worker_pids
    del llm
    gc.collect()  # weakref.finalize: no explicit shutdown() needed
    assert all(not p.is_alive() for p in procs)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]


def test_killed_worker_raises_instead_of_hanging(tiny_models, monkeypatch):
    monkeypatch.setenv("REPLAYLLM_TP_TIMEOUT_S", "30")
    llm = LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=2))
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    (pid,) = llm.llm_engine.runner.worker_pids
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))  # mid-run: inside a step's collectives
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match="tensor-parallel worker failed"):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(temperature=0, max_tokens=240),
                     use_tqdm=False)
    killer.join()
    assert time.monotonic() - start < 30
    # The group is down: later calls fail at once with the same cause, and no worker is left.
    with pytest.raises(RuntimeError, match="failed earlier"):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], params, use_tqdm=False)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]
    llm.llm_engine.shutdown()  # idempotent


def test_worker_error_is_reported(tiny_models, monkeypatch):
    monkeypatch.setenv("REPLAYLLM_TP_TIMEOUT_S", "30")
    llm = LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=2))
    runner = llm.llm_engine.runner
    runner._workers.conns[0].send(("no-such-message", None))  # the worker raises, reports, exits
    with pytest.raises(RuntimeError, match="unknown message 'no-such-message'"):
        llm.generate([{"prompt_token_ids": [4, 5, 6]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]
