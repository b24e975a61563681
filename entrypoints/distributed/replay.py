"""replay(): a trace set in, per-token logprobs out (JSONL or parquet), on one engine or on Ray replicas."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..diff.trace_file import TraceFileError, TraceRecord, iter_trace_file
from .jobs import ReplayJob, Shard
from .options import ScaleOut
from .packed import PackedTraces
from .pool import default_max_num_seqs, make_pool
from .writers import TokenWriter, output_format

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    """What replay() wrote: where, how much, and what the engine resolved to."""

    path: str
    format: str  # "jsonl" | "parquet"
    num_requests: int
    num_tokens: int
    seconds: float  # the whole call: replicas started, traces replayed and written, replicas stopped
    run_seconds: float  # replaying and writing only (from the first shard sent to the last row written)
    engine_seconds: float  # of which the replicas' engines ran shards (summed over replicas; see Ran)
    data_parallel_size: int
    retries: int  # shards run again because their replica died
    resolved: dict[str, Any]  # the (first) replica's engine facts: dtype, device, ... (diff/resolved.py)


def replay(traces: str | os.PathLike | Sequence[TraceRecord], out: str | os.PathLike, *, model: str | None = None,
           logprobs: int = 0, format: str | None = None, data_parallel_size: int = 1, ray_address: str | None = None,
           shard_size: int | None = None, progress: bool = False, **engine_options: Any) -> ReplayResult:
    """Replay every trace and write one row per trace token (request_id, position, token_id, logprob, rank,
    and with logprobs=k > 0 the top-k top_token_ids / top_logprobs) to `out`, in the input order.

    traces: a trace file (docs/diff.md; read twice, streamed: validated and counted, then replayed) or
    TraceRecords. format: "jsonl" | "parquet" (None: from out's extension). data_parallel_size > 1 or a
    ray_address runs that many engine replicas as Ray actors (the Ray session this process has, else
    ray_address, else a local one); otherwise one engine runs here, without Ray. shard_size: requests per shard
    (None: min(max_num_seqs, requests / replicas)). engine_options: LLM(...) options (enable_trace_replay is
    always on). Shards are written as they complete, in order; early ones wait on disk.
    """
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0:
        raise ValueError(f"logprobs must be an integer >= 0, got {logprobs!r}")
    if engine_options.get("enable_trace_replay") is False:
        raise ValueError("replay replays traces: enable_trace_replay=False cannot be honoured")
    scale_out = ScaleOut(data_parallel_size, ray_address, shard_size)
    fmt = output_format(os.fspath(out), format)
    source = _TraceSource(traces)
    options = {**engine_options, "enable_trace_replay": True}
    if not source.needs_tokenizer:  # every prompt is token ids and nothing is detokenized: no tokenizer to load
        options["skip_tokenizer_init"] = True
    options["max_logprobs"] = max(options.get("max_logprobs") or 0, logprobs)
    size = scale_out.shard_size_for(source.num_requests, default_max_num_seqs(options))
    bar = _progress(progress, source.num_requests)
    t0 = time.perf_counter()
    writer = TokenWriter(out, fmt, logprobs)
    try:
        with make_pool(scale_out, model, options) as pool:
            ids = _ShardIds()
            t_run = time.perf_counter()
            pool.run(ReplayJob(logprobs), ids.track(source.shards(size)),
                     lambda index, cols: writer.write(ids.pop(index), cols),
                     on_shard=(lambda shard: bar.update(len(shard))) if bar else None)
            run_seconds = time.perf_counter() - t_run
            resolved = pool.resolved()
            retries = getattr(pool, "retries", 0)
            engine_seconds = pool.engine_seconds
    finally:
        writer.close()
        if bar:
            bar.close()
    return ReplayResult(os.fspath(out), fmt, writer.num_requests, writer.num_tokens, time.perf_counter() - t0,
                        run_seconds, engine_seconds, scale_out.data_parallel_size, retries, resolved)


class _TraceSource:
    """The traces, counted up front (for the progress bar and the shard size) and cut into shards lazily."""

    def __init__(self, traces: str | os.PathLike | Sequence[TraceRecord]):
        self.path = os.fspath(traces) if isinstance(traces, (str, os.PathLike)) else None
        self.records = None if self.path is not None else list(traces)
        self.needs_tokenizer = False  # some prompt is text only
        self.with_routes = 0  # records that store routed_experts (not replayed: warned)
        if self.path is not None:  # first pass: validate every line, keep the count and whether text needs tokenizing
            self.num_requests = 0
            for item in iter_trace_file(self.path):
                if isinstance(item, TraceRecord):
                    self.num_requests += 1
                    self.needs_tokenizer |= item.prompt_token_ids is None
                    self.with_routes += item.routed_experts is not None
        else:
            if not all(isinstance(r, TraceRecord) for r in self.records):
                raise TypeError("traces must be a trace file path or a sequence of TraceRecords")
            if len({r.id for r in self.records}) != len(self.records):
                raise TraceFileError("trace ids must be unique")
            self.num_requests = len(self.records)
            self.needs_tokenizer = any(r.prompt_token_ids is None for r in self.records)
            self.with_routes = sum(r.routed_experts is not None for r in self.records)
        if not self.num_requests:
            raise TraceFileError("no traces to replay")
        if self.with_routes:  # never silently: the replay routes freely (a MoE model's routes may differ)
            logger.warning("%d of %d traces store routed_experts: replay does not force them (the model routes each "
                           "token itself); to replay recorded routes use `replayllm diff --fix-routes` or "
                           "SamplingParams(trace_routed_experts=...)", self.with_routes, self.num_requests)

    def shards(self, size: int) -> Iterator[Shard]:
        items: Iterable = (iter_trace_file(self.path) if self.path is not None else self.records)
        batch: list[TraceRecord] = []
        index = start = 0
        for item in items:
            if not isinstance(item, TraceRecord):
                continue  # the provenance header
            batch.append(item)
            if len(batch) == size:
                yield Shard(index, start, batch)
                index, start, batch = index + 1, start + size, []
        if batch:
            yield Shard(index, start, batch)


class _ShardIds:
    """The request ids of each dispatched shard until its rows are written (the replicas need not send them)."""

    def __init__(self):
        self.ids: dict[int, list[str]] = {}

    def track(self, shards: Iterator[Shard]) -> Iterator[Shard]:
        """Shards of TraceRecords in, the same shards as PackedTraces out (what travels to a replica)."""
        for shard in shards:
            self.ids[shard.index] = [r.id for r in shard.items]
            yield Shard(shard.index, shard.start, PackedTraces.of(shard.items))

    def pop(self, index: int) -> list[str]:
        return self.ids.pop(index)


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Replayed traces", unit="req", dynamic_ncols=True)
