"""ClientOutputRouter: the engine core's messages -> text, stop strings, RequestOutputs on per-call streams."""

from __future__ import annotations

import collections
import time

import numpy as np

from ..sampling_params import RequestOutputKind
from ..step_io import PromptLogprobsChunk
from .core_messages import CoreOutputs
from .engine_stats import EngineSnapshot
from .input_processor import InputProcessor, PreparedRequest
from .output_processor import OutputProcessor, ended_by_token
from .request import child_request_id
from .request_stream import EngineAsleepError, EngineStepError, Tracked, request_timing


class ClientOutputRouter:
    """Lives on the API server's event loop. Holds each request's output state (OutputProcessor: incremental
    detokenization, stop strings, FlatLogprobs) and its stream; `apply` takes one CoreOutputs (one engine step)
    and hands each touched request's newest output to its stream, one delivery per request per step;
    `apply_many` takes the messages that queued up while this process was busy and delivers once per request
    for all of them (one chunk carrying several steps' tokens: when the server falls behind the engine, its
    per-chunk work -- rendering, framing, the socket write -- shrinks per token instead of the lag growing). A
    stop string found here ends the request here and aborts it in the core, as vLLM's output processor does."""

    def __init__(self, inputs: InputProcessor, client):
        """client: the EngineCoreClient (its stats, snapshot, resolve_call and send_abort are used)."""
        self.processor = OutputProcessor(inputs.tokenizer, inputs.decode_token)
        self.client = client
        self.tracked: dict[str, Tracked] = {}
        self.stopped_here: set[str] = set()  # unfinished requests with a sequence ended here by a stop string

    def add(self, request_id: str, prepared: PreparedRequest, tracked: Tracked) -> None:
        p = prepared.params
        self.processor.add_request(request_id, prepared.prompt, prepared.prompt_token_ids,
                                   [child_request_id(request_id, i, p.n) for i in range(p.n)], p)
        self.tracked[request_id] = tracked

    def abort(self, request_ids: list[str], error_type: type[BaseException]) -> list[str]:
        """Drop these requests here (their streams get error_type); the ids that were still in flight."""
        return [rid for rid in request_ids
                if self._end(rid, "abort", error_type(f"request {rid} was aborted"))]

    def fail_all(self, error: BaseException) -> None:
        for rid in list(self.tracked):
            self._end(rid, "error", error)

    def _end(self, rid: str, reason: str, error: BaseException) -> bool:
        """End an unfinished request here with `error` (its sequences counted as `reason`); False if unknown."""
        tracked = self.tracked.pop(rid, None)
        if tracked is None:
            return False
        self.processor.abort(rid)
        self.stopped_here.discard(rid)
        for _ in range(tracked.num_seqs):
            self.client.stats.on_seq_finished(reason)
        tracked.stream.deliver(tracked.index, error)
        return True

    def apply(self, msg: CoreOutputs) -> None:
        self.apply_many([msg])

    def apply_many(self, msgs: list[CoreOutputs]) -> None:
        """Consecutive messages in their order; each touched request's output is delivered once, at the end."""
        touched: dict[str, tuple] = {}  # parent id -> (parent state, the message that touched it last)
        for msg in msgs:
            self._apply_one(msg, touched)
        if touched:
            self._deliver(touched)

    def _apply_one(self, msg: CoreOutputs, touched: dict[str, tuple]) -> None:
        client, stats = self.client, self.client.stats
        if msg.snapshot:
            client.snapshot = EngineSnapshot.from_fields(msg.snapshot)
        for call_id, ok, result in msg.utility:
            client.resolve_call(call_id, ok, result)
        if msg.step_error is not None:
            stats.on_step_error()
            error = EngineStepError(msg.step_error)
            for rid in msg.failed:
                self._end(rid, "error", error)
        for rid, message in msg.rejected:
            self._end(rid, "error", ValueError(message))
        for rid in msg.asleep:  # the core slept when it came (another API server process put it to sleep)
            self._end(rid, "abort", EngineAsleepError("the engine is asleep (sleep mode): wake it up before "
                                                      "sending requests"))
        if msg.num_step_reqs:  # before any output is delivered: /metrics read after a response shows its tokens
            stats.on_step(msg.num_step_reqs, msg.num_step_tokens)
        for parent_id, started in msg.scheduled.items():
            tracked = self.tracked.get(parent_id)
            if tracked is not None and tracked.scheduled is None:
                tracked.scheduled = started
        for part in msg.prompt_logprobs:
            self.processor.add_prompt_logprobs(part.request_id, PromptLogprobsChunk(
                part.start, np.asarray(part.token_ids), np.asarray(part.logprob), np.asarray(part.rank),
                np.asarray(part.topk_ids).reshape(len(part.token_ids), -1),
                np.asarray(part.topk_logprobs).reshape(len(part.token_ids), -1)))
        if msg.req_ids:
            self._tokens(msg, touched)

    def _tokens(self, msg: CoreOutputs, touched: dict[str, tuple]) -> None:
        processor, children = self.processor, self.processor.children
        finished = {cid: (reason, stop) for cid, reason, stop in msg.finished}
        routes = {part.request_id: part for part in msg.routed_experts}  # finished sequences' MoE routes
        has_lp, has_topk = bool(msg.logprob), bool(msg.topk_ids)
        last = {cid: r for r, cid in enumerate(msg.req_ids)}  # a fast-replay request has several rows: its last
        # Only with full logprobs (rare): rows per request (its full logprobs are [rows, V]) and rows seen so far.
        rows = collections.Counter(msg.req_ids) if msg.full_logprobs else None
        nth: dict[str, int] = {}
        for r, cid in enumerate(msg.req_ids):
            child = children.get(cid)
            if rows is not None:
                j = nth[cid] = nth.get(cid, -1) + 1
            if child is None or child.parent.completions[child.index].finish_reason is not None:
                continue  # aborted here, or ended here by a stop string (n > 1: its siblings still run)
            lp = None
            if child.num_logprobs is not None and has_lp:
                lp = (msg.logprob[r], msg.rank[r], msg.topk_ids[r] if has_topk else [],
                      msg.topk_logprobs[r] if has_topk else [], 0)
            full = None
            if child.full_logprobs:
                full = np.frombuffer(msg.full_logprobs[cid], dtype=np.float32).reshape(rows[cid], -1)[j]
            ended = finished.get(cid) if last[cid] == r else None
            stop = processor.append_token(child, msg.token_ids[r], msg.num_cached_tokens[r], lp, full,
                                          ended is not None and ended_by_token(*ended))
            if stop is not None:
                processor.finish_child(child, "stop", stop)
                if ended is None:  # (the core already ended one whose last token completed a stop string)
                    self.stopped_here.add(child.parent.request_id)
            elif ended is not None:
                processor.finish_child(child, *ended)
            if ended is not None and cid in routes:  # (a sequence a stop string ended here has none)
                child.parent.completions[child.index].routed_experts = routes[cid].array()
            parent_id = child.parent.request_id
            tracked = self.tracked.get(parent_id)
            if tracked is not None and tracked.first_token is None:
                tracked.first_token = msg.step_ended
                # The core's step end -> here (one monotonic clock on one host): ZMQ and this loop's backlog.
                self.client.stats.on_first_token_delivered(time.monotonic() - msg.step_ended)
            touched[parent_id] = (child.parent, msg)

    def _deliver(self, touched: dict[str, tuple]) -> None:
        """Each touched request's newest output to its stream; a request ended meanwhile (a later message's step
        error) already has its error and gets nothing more."""
        live = {rid: t for rid, t in touched.items() if rid in self.tracked}
        core_aborts, queued = [], []
        for parent, _ in live.values():
            tracked = self.tracked[parent.request_id]
            stream = tracked.stream
            # A sink renders and writes the output at once and keeps nothing: it gets the live state, no copy
            # (declined, e.g. under back-pressure: the copy below is queued for the reader instead).
            if (not parent.finished and parent.output_kind is RequestOutputKind.CUMULATIVE and stream.sink_ready()
                    and stream.sink(tracked.index, parent.to_output(live=True))):
                continue
            queued.append(parent)
        for out in self.processor.collect(queued):
            tracked = self.tracked.get(out.request_id) if not out.finished else self.tracked.pop(out.request_id)
            if out.finished:
                msg = live[out.request_id][1]
                for c in out.outputs:
                    self.client.stats.on_seq_finished(c.finish_reason or "stop")
                if any(c.finish_reason in ("stop", "length") for c in out.outputs):
                    self.client.stats.on_request_finished(
                        request_timing(tracked, out, msg.step_started, msg.step_ended))
                if out.request_id in self.stopped_here:  # the core still runs what a stop string ended here
                    self.stopped_here.discard(out.request_id)
                    core_aborts.append(out.request_id)
            tracked.stream.deliver(tracked.index, out)
        if core_aborts:
            self.client.send_abort(core_aborts)
