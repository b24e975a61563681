"""What the engine thread reports for metrics: the StatsSink callbacks, a finished request's timing, the
engine's gauges."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class StatsSink:
    """What the engine thread reports as it runs (the server's metrics implement it). Called on the engine
    thread, so implementations must be thread-safe; the default does nothing."""

    def on_request_added(self, num_prompt_tokens: int, num_seqs: int, has_trace: bool) -> None:
        pass

    def on_step(self, num_reqs: int, num_new_tokens: int) -> None:
        pass

    def on_seq_finished(self, reason: str) -> None:  # "stop" | "length" | "abort" | "error", per sequence
        pass

    def on_step_error(self) -> None:
        pass

    def on_request_finished(self, timing: RequestTiming) -> None:  # finished by stop or length, not aborted
        pass

    def on_first_token_delivered(self, seconds: float) -> None:  # its step's end -> the API process handled it
        pass


@dataclass(frozen=True)
class RequestTiming:
    """One engine request (all its n sequences) that finished: latencies in seconds (time.monotonic) and sizes."""

    queue_time: float  # added -> the start of the step that first scheduled it
    time_to_first_token: float  # added -> the end of the step whose output held its first token
    e2e_latency: float  # added -> finished
    num_prompt_tokens: int
    num_generation_tokens: int  # over all sequences
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    time_per_output_token: float | None  # (e2e - first token) / (longest sequence - 1); None below 2 tokens


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges, published by the engine thread after every loop turn (read by /metrics, any thread)."""

    num_running: int = 0  # sequences
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    num_steps: int = 0
    max_running_in_step: int = 0
    num_preemptions: int = 0
    num_prefix_cache_hit_tokens: int = 0
    # 1 while sleep mode holds any part: every API server process reads it from the core's messages, so a request
    # to an engine another process put to sleep is answered 503 at once, never a started stream (core_client.py)
    sleeping: int = 0
    # Speculative decoding (SpecDecodeStats; all 0 and per_pos empty when it is off).
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_tokens_per_pos: tuple[int, ...] = ()  # [k] drafts accepted at each draft position

    @classmethod
    def of(cls, engine) -> EngineSnapshot:
        """The gauges of an LLMEngine now."""
        spec = engine.scheduler.spec_stats
        return cls(num_running=len(engine.scheduler.running), num_waiting=len(engine.scheduler.waiting),
                   num_kv_blocks=engine.block_manager.num_blocks,
                   num_free_kv_blocks=engine.block_manager.num_free_blocks, num_steps=engine.num_steps,
                   max_running_in_step=engine.max_running_in_step,
                   num_preemptions=engine.scheduler.num_preemptions,
                   num_prefix_cache_hit_tokens=engine.block_manager.num_prefix_hits,
                   sleeping=int(engine.is_sleeping()),
                   num_spec_drafts=spec.num_drafts, num_spec_draft_tokens=spec.num_draft_tokens,
                   num_spec_accepted_tokens=spec.num_accepted_tokens,
                   spec_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos))

    def fields(self) -> tuple[int, ...]:
        """The values as flat ints (the engine core's wire form; `from_fields` reads it back): the scalar fields
        in order, then the per-position counts."""
        *scalars, per_pos = (getattr(self, f.name) for f in dataclasses.fields(self))
        return (*scalars, *per_pos)

    @classmethod
    def from_fields(cls, values) -> EngineSnapshot:
        n = len(dataclasses.fields(cls)) - 1
        return cls(*values[:n], tuple(values[n:])) if len(values) >= n else cls(*values)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_kv_blocks / max(1, self.num_kv_blocks)
