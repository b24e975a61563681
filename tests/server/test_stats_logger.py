"""The server's periodic stats line (StatsLogger) and --disable-log-stats."""

from __future__ import annotations

import logging

import pytest

from replayllm.engine.engine_stats import EngineSnapshot, RequestTiming
from replayllm.entrypoints.cli.main import build_parser
from replayllm.entrypoints.http.metrics import ServerMetrics
from replayllm.entrypoints.http.stats_logger import DEFAULT_INTERVAL, INTERVAL_ENV, StatsLogger, log_stats_interval


def test_stats_line_reports_rates_requests_kv_cache_and_hit_rate(caplog):
    metrics = ServerMetrics()
    now = [100.0]
    snap = EngineSnapshot(num_running=2, num_waiting=1, num_kv_blocks=10, num_free_kv_blocks=7)
    stats = StatsLogger(metrics, lambda: snap, interval=10.0, clock=lambda: now[0])
    metrics.on_request_added(num_prompt_tokens=100, num_seqs=1, has_trace=False)
    metrics.on_step(num_reqs=2, num_new_tokens=30)
    metrics.on_step(num_reqs=2, num_new_tokens=20)
    metrics.on_request_finished(RequestTiming(queue_time=0.1, time_to_first_token=0.2, e2e_latency=1.0,
                                              num_prompt_tokens=100, num_generation_tokens=50, num_cached_tokens=25,
                                              time_per_output_token=0.01))
    now[0] = 110.0
    caplog.set_level(logging.DEBUG, logger="replayllm.stats")
    stats.log()
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage() == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 30.0%, Prefix cache hit rate: 25.0%")
    now[0] = 120.0  # no traffic since: the zero rates still go to INFO once (the previous interval was busy) ...
    stats.log()
    assert caplog.records[-1].levelno == logging.INFO
    assert caplog.records[-1].getMessage().startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                                      "throughput: 0.0 tokens/s")
    now[0] = 130.0  # ... then an idle server stays quiet at INFO (vLLM's behaviour)
    stats.log()
    assert caplog.records[-1].levelno == logging.DEBUG


def test_interval_default_env_and_disable(monkeypatch):
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert log_stats_interval(False) == DEFAULT_INTERVAL == 10.0
    assert log_stats_interval(True) is None
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert log_stats_interval(False) == 0.5
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match=INTERVAL_ENV):
        log_stats_interval(False)
    assert log_stats_interval(True) is None  # off: the variable is not read
    assert build_parser().parse_args(["serve", "--disable-log-stats"]).disable_log_stats is True
    assert build_parser().parse_args(["serve"]).disable_log_stats is False


def test_app_logs_stats_only_when_asked(caplog):
    """In-process apps: an interval starts the stats task with the engine loop, None (the default of build_app,
    and what --disable-log-stats passes) starts none."""
    import time

    from fastapi.testclient import TestClient

    from replayllm.config import EngineConfig
    from replayllm.engine.llm_engine import LLMEngine
    from replayllm.entrypoints.openai.api_server import build_app

    engine = LLMEngine(EngineConfig(device="cpu", dtype="float32", max_model_len=128))
    assert build_app(engine=engine).state.stats_logger is None  # never started: the engine is free for the next
    app = build_app(engine=engine, log_stats_interval=0.05)
    caplog.set_level(logging.INFO, logger="replayllm.stats")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": app.state.async_engine.engine.config.served_model_name,
                                            "prompt": "Hello there", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while not any(rec.name == "replayllm.stats" and rec.levelno == logging.INFO for rec in caplog.records):
            assert time.monotonic() < deadline, "no stats line within 60 s"
            time.sleep(0.05)
    line = next(rec.getMessage() for rec in caplog.records if rec.name == "replayllm.stats")
    assert line.startswith("Avg prompt throughput: ") and "KV cache usage" in line


def test_route_labels_name_every_generation_route():
    """/inference/v1/generate and the Responses API get their own label (a 499 there was counted as "other")."""
    from replayllm.entrypoints.http.metrics import route_label
    assert [route_label(p) for p in ("/inference/v1/generate", "/v1/responses", "/v1/responses/resp_1", "/sleep")] \
        == ["/inference/v1/generate", "/v1/responses", "/v1/responses/{response_id}", "other"]
