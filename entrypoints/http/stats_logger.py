"""StatsLogger: the server's periodic stats line (vLLM's LoggingStatLogger): throughput, requests, KV cache,
prefix-cache hit rate, speculative acceptance; `replayllm serve --disable-log-stats` turns it off."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from ...engine.engine_stats import EngineSnapshot
from .metrics import ServerMetrics

logger = logging.getLogger("replayllm.stats")
INTERVAL_ENV = "REPLAYLLM_LOG_STATS_INTERVAL"  # seconds between lines (vLLM: VLLM_LOG_STATS_INTERVAL)
DEFAULT_INTERVAL = 10.0


def log_stats_interval(disable_log_stats: bool) -> float | None:
    """Seconds between stats lines for `replayllm serve` (None: off); ValueError on a bad environment value."""
    if disable_log_stats:
        return None
    text = os.environ.get(INTERVAL_ENV)
    if text is None:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds > 0, got {text!r}")
    return value


class StatsLogger:
    """One line per interval from the server's metrics (totals, read on the event loop) and the engine's
    latest snapshot. An idle engine's line goes to DEBUG, as vLLM's, so an idle server stays quiet."""

    def __init__(self, metrics: ServerMetrics, snapshot: Callable[[], EngineSnapshot], interval: float,
                 clock: Callable[[], float] = time.monotonic):
        self.metrics, self.snapshot, self.interval, self.clock = metrics, snapshot, interval, clock
        self._last = (clock(), metrics.prompt_tokens_total, metrics.generation_tokens_total)
        self._last_rates = (0.0, 0.0)
        self._last_spec = (0, 0, 0)  # speculative decoding: (drafts, draft tokens, accepted) at the last line

    def line(self) -> tuple[str, bool]:
        """The stats since the previous call and whether there was any traffic (in this or the last interval)."""
        now, prompt, generated = self.clock(), self.metrics.prompt_tokens_total, self.metrics.generation_tokens_total
        then, prompt0, generated0 = self._last
        elapsed = max(now - then, 1e-9)
        rates = ((prompt - prompt0) / elapsed, (generated - generated0) / elapsed)
        busy = any(rates) or any(self._last_rates)
        self._last, self._last_rates = (now, prompt, generated), rates
        s = self.snapshot()
        return (f"Avg prompt throughput: {rates[0]:.1f} tokens/s, Avg generation throughput: {rates[1]:.1f} "
                f"tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, KV cache usage: "
                f"{100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * self.metrics.hit_rate:.1f}%"
                + self._spec_part(s)), busy

    def _spec_part(self, s: EngineSnapshot) -> str:
        """Speculative decoding over the interval (vLLM's SpecDecoding line, shortened): accepted / drafted
        tokens and the mean acceptance length (1 + accepted per draft). Empty when speculation is off."""
        if not s.spec_accepted_tokens_per_pos:
            return ""
        now = (s.num_spec_drafts, s.num_spec_draft_tokens, s.num_spec_accepted_tokens)
        drafts, drafted, accepted = (a - b for a, b in zip(now, self._last_spec))
        self._last_spec = now
        rate = 100 * accepted / drafted if drafted else 0.0
        length = 1 + accepted / drafts if drafts else 0.0
        return (f", Spec decode acceptance rate: {rate:.1f}% ({accepted}/{drafted} tokens), "
                f"Mean acceptance length: {length:.2f}")

    def log(self) -> None:
        text, busy = self.line()
        (logger.info if busy else logger.debug)(text)

    async def run(self) -> None:
        """Log every interval until cancelled (the app's lifespan cancels it at shutdown)."""
        while True:
            await asyncio.sleep(self.interval)
            self.log()
