"""ServerMetrics: Prometheus metrics of the server and engine (own CollectorRegistry), served at /metrics; summed
over every API server process's files under `--api-server-count N` (multiprocess_metrics.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...engine.engine_stats import EngineSnapshot, RequestTiming, StatsSink
from . import multiprocess_metrics

PREFIX = "replayllm:"
# Routes counted under their own label; anything else is "other" (keeps label cardinality bounded).
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate", "/v1/models",
          "/tokenize", "/detokenize", "/health", "/version", "/metrics")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# vLLM's buckets for the same histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000


# prometheus_client >= 0.17 keeps a gauge's most recent value across processes; older ones offer the largest.
_LATEST_MODE = "mostrecent" if "mostrecent" in getattr(Gauge, "_MULTIPROC_MODES", ()) else "max"


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{response_id}"
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
        if s.spec_accepted_tokens_per_pos:  # speculative decoding is on: vLLM's spec_decode_* counters
            yield from _spec_decode_counters(s)


def _spec_decode_counters(s: EngineSnapshot) -> Iterator:
    for name, doc, value in (
            ("spec_decode_num_drafts", "Speculative drafts verified (one per request per step with drafts).",
             s.num_spec_drafts),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified.", s.num_spec_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", s.num_spec_accepted_tokens)):
        yield CounterMetricFamily(PREFIX + name, doc, value=value)
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Drafted tokens accepted, by position in the draft.", labels=["position"])
    for i, value in enumerate(s.spec_accepted_tokens_per_pos):
        per_pos.add_metric([str(i)], value)
    yield per_pos


class ServerMetrics(StatsSink):
    """Counters fed by the HTTP middleware and (through StatsSink, thread-safe) by the engine thread.
    count_steps: count the engine's steps (batch sizes, generated tokens) here. Under `--api-server-count N` every
    process hears of every step, and /metrics sums the processes: only the first one counts them."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, count_steps: bool = True):
        self.count_steps = count_steps
        self.multiprocess = multiprocess_metrics.active()
        self._engine_collector: Collector | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP requests by route and status code.",
                                     ["route", "status"], registry=r)
        # A streamed completion's response starts once its request is handed to the engine: this is its intake
        # (body read, parsed, checked, queued) plus any wait for this process's event loop.
        self.http_response_start = Histogram(PREFIX + "http_response_start_seconds", "HTTP request received -> "
                                             "its response started, by route (a stream: its intake).", ["route"],
                                             buckets=TTFT_BUCKETS, registry=r)
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

        # Per finished request (stop or length; aborted and failed requests are not observed), as vLLM's.
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token: added to the engine "
                              "-> the step that produced it.", buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds", "Mean time per output token after "
                              "the first, per request with 2+ tokens.", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Added to the engine -> finished.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Added to the engine -> first "
                                    "scheduled.", buckets=LATENCY_BUCKETS, registry=r)
        # Per request (served by an engine core process): how late its first token reached this API process.
        self.first_token_delivery = Histogram(PREFIX + "first_token_delivery_seconds", "End of the engine step "
                                              "that made a request's first token -> this API process handled it.",
                                              buckets=TTFT_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per request.",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per "
                                                   "request (all n sequences).", buckets=TOKEN_BUCKETS, registry=r)
        # Several processes: the most recently set value of any of them (each computes it over its own requests).
        self.prefix_cache_hit_rate = Gauge(PREFIX + "prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                                           "cache / prompt tokens, over finished requests (0 before any).",
                                           registry=r, multiprocess_mode=_LATEST_MODE)
        self._prompt_sum = self._cached_sum = 0  # engine thread only
        # Plain totals for the stats line (http/stats_logger.py): written on the engine thread, read anywhere.
        self.prompt_tokens_total = self.generation_tokens_total = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens, over finished requests (0 before any)."""
        return self._cached_sum / max(1, self._prompt_sum)

    def attach_engine(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._engine_collector = _EngineCollector(snapshot)
        self.registry.register(self._engine_collector)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()  # every process's files, summed; the engine's own numbers once
        multiprocess.MultiProcessCollector(registry)
        if self._engine_collector is not None:
            registry.register(self._engine_collector)
        return generate_latest(registry)

    # -- HTTP (event loop) -------------------------------------------------------------------------------
    def on_http_response(self, path: str, status: int) -> None:
        self.http_requests.labels(route_label(path), str(status)).inc()

    def on_http_response_start(self, path: str, seconds: float) -> None:
        self.http_response_start.labels(route_label(path)).observe(seconds)

    # -- StatsSink (engine thread) -----------------------------------------------------------------------
    def on_request_added(self, num_prompt_tokens: int, num_seqs: int, has_trace: bool) -> None:
        self.requests_added.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.prompt_tokens_total += num_prompt_tokens
        if has_trace:
            self.trace_requests.inc()

    def on_step(self, num_reqs: int, num_new_tokens: int) -> None:
        if not self.count_steps:
            return
        self.batch_size.observe(num_reqs)
        self.generation_tokens.inc(num_new_tokens)
        self.generation_tokens_total += num_new_tokens

    def on_seq_finished(self, reason: str) -> None:
        self.finished.labels(reason).inc()

    def on_step_error(self) -> None:
        self.step_errors.inc()

    def on_first_token_delivered(self, seconds: float) -> None:
        self.first_token_delivery.observe(seconds)

    def on_request_finished(self, timing: RequestTiming) -> None:
        self.ttft.observe(timing.time_to_first_token)
        if timing.time_per_output_token is not None:
            self.tpot.observe(timing.time_per_output_token)
        self.e2e.observe(timing.e2e_latency)
        self.queue_time.observe(timing.queue_time)
        self.request_prompt_tokens.observe(timing.num_prompt_tokens)
        self.request_generation_tokens.observe(timing.num_generation_tokens)
        self._prompt_sum += timing.num_prompt_tokens
        self._cached_sum += timing.num_cached_tokens
        self.prefix_cache_hit_rate.set(self.hit_rate)
