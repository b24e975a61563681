"""ServerMetrics: Prometheus metrics of the server and engine (own CollectorRegistry), served at /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..engine.async_engine import EngineSnapshot, StatsSink

PREFIX = "replayllm:"
# Routes counted under their own label; anything else is "other" (keeps label cardinality bounded).
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/version",
          "/metrics")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


class _EngineCollector(Collector):
    """Engine gauges read at scrape time from the snapshot the engine thread publishes."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterator:
        s = self._snapshot()
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", s.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage),
            ("num_kv_blocks", "KV-cache blocks in total.", s.num_kv_blocks),
            ("num_free_kv_blocks", "KV-cache blocks free (cached prefixes in free blocks count as free).",
             s.num_free_kv_blocks),
            ("max_num_running_in_step", "Most requests batched in one engine step so far.",
             s.max_running_in_step),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = (
            ("engine_steps", "Engine steps run.", s.num_steps),
            ("num_preemptions", "Requests preempted (recomputed later) for lack of KV blocks.", s.num_preemptions),
            ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             s.num_prefix_cache_hit_tokens),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(PREFIX + name, doc, value=value)


class ServerMetrics(StatsSink):
    """Counters fed by the HTTP middleware and (through StatsSink, thread-safe) by the engine thread."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests by route and status code.",
                                     ["route", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated (or replayed).",
                                         registry=r)
        self.requests_added = Counter(PREFIX + "requests_added", "Engine requests accepted (one per prompt).",
                                      registry=r)
        self.trace_requests = Counter(PREFIX + "trace_replay_requests",
                                      "Engine requests that replay a trace (trace_decode_token_ids).", registry=r)
        self.finished = Counter(PREFIX + "requests_finished",
                                "Sequences finished, by reason: stop | length | abort | error.",
                                ["finished_reason"], registry=r)
        self.step_errors = Counter(PREFIX + "engine_step_errors",
                                   "Engine steps that raised (their requests failed; the loop went on).",
                                   registry=r)
        self.batch_size = Histogram(PREFIX + "batch_size", "Requests in one engine step (continuous batching).",
                                    buckets=BATCH_BUCKETS, registry=r)

    def attach_engine(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry.register(_EngineCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- HTTP (event loop) -------------------------------------------------------------------------------
    def on_http_response(self, path: str, status: int) -> None:
        self.http_requests.labels(route_label(path), str(status)).inc()

    # -- StatsSink (engine thread) -----------------------------------------------------------------------
    def on_request_added(self, num_prompt_tokens: int, num_seqs: int, has_trace: bool) -> None:
        self.requests_added.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        if has_trace:
            self.trace_requests.inc()

    def on_step(self, num_reqs: int, num_new_tokens: int) -> None:
        self.batch_size.observe(num_reqs)
        self.generation_tokens.inc(num_new_tokens)

    def on_seq_finished(self, reason: str) -> None:
        self.finished.labels(reason).inc()

    def on_step_error(self) -> None:
        self.step_errors.inc()
