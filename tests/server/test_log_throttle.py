"""RepeatFilter: identical error log lines are rate-limited, with a count of those left out; others pass."""

from __future__ import annotations

import logging

from replayllm.entrypoints.http.log_throttle import RepeatFilter


def access(path: str, status: int, port: int = 5000) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             (f"127.0.0.1:{port}", "POST", path, "1.1", status), None)


def error(msg: str) -> logging.LogRecord:
    return logging.LogRecord("replayllm.server", logging.ERROR, __file__, 1, msg, None, None)


def test_identical_error_lines_are_rate_limited():
    now = [0.0]
    f = RepeatFilter(window_s=10, clock=lambda: now[0])
    assert f.filter(access("/v1/completions", 400, 1))
    assert not any(f.filter(access("/v1/completions", 400, port)) for port in range(2, 50))  # other ports too
    assert f.filter(access("/v1/completions", 413))  # another status
    assert f.filter(access("/tokenize", 400))  # another path
    assert f.filter(error("engine step failed")) and not f.filter(error("engine step failed"))
    now[0] = 10.5
    rec = access("/v1/completions", 400)
    assert f.filter(rec)
    assert "and 48 more like this" in rec.getMessage()
    assert f.filter(access("/v1/completions", 400)) is False  # a new window started


def test_successes_and_info_lines_always_pass():
    f = RepeatFilter(window_s=10, clock=lambda: 0.0)
    assert all(f.filter(access("/v1/completions", 200)) for _ in range(100))
    info = logging.LogRecord("replayllm.server", logging.INFO, __file__, 1, "serving", None, None)
    assert f.filter(info) and f.filter(info)


def test_remembers_a_bounded_number_of_kinds():
    f = RepeatFilter(window_s=10, clock=lambda: 0.0)
    for i in range(5000):
        f.filter(access(f"/v1/nope/{i}", 404))
    assert len(f._seen) <= 1024
