"""CoreOutputCollector: the engine core's output processor; turns a step into one CoreOutputs (ids, no text)."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling_params import SamplingParams
from ..step_io import ModelRunnerOutput
from .core_messages import CoreOutputs, PromptLogprobsPart, RoutedExpertsPart
from .request import Request
from .scheduler import Scheduler


@dataclass
class CoreParent:
    """A request (one prompt, n sequences) as the core knows it: only what finishing and aborting need."""

    request_id: str
    child_ids: list[str]
    wants_prompt_logprobs: bool
    num_finished: int = 0


class CoreOutputCollector:
    """The engine core process's OutputSink (engine_core.py), where OutputProcessor is in process: `process`
    returns the step's CoreOutputs (flat arrays) instead of RequestOutputs. Stop strings, text and logprob
    objects are the API server's business (OutputProcessor.append_token there)."""

    def __init__(self) -> None:
        self.parents: dict[str, CoreParent] = {}
        self._parent_of: dict[str, CoreParent] = {}  # child id -> its parent

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], child_ids: list[str],
                    p: SamplingParams) -> None:
        parent = CoreParent(parent_id, list(child_ids), p.prompt_logprobs is not None)
        self.parents[parent_id] = parent
        for cid in child_ids:
            self._parent_of[cid] = parent

    def abort(self, parent_id: str) -> CoreParent | None:
        parent = self.parents.pop(parent_id, None)
        if parent is not None:
            for cid in parent.child_ids:
                self._parent_of.pop(cid, None)
        return parent

    def process(self, produced: list[Request], out: ModelRunnerOutput, scheduler: Scheduler) -> CoreOutputs:
        msg = CoreOutputs()
        for rid, chunk in out.prompt_logprobs.items():
            parent = self._parent_of.get(rid)
            if parent is not None and parent.wants_prompt_logprobs and parent.child_ids[0] == rid:
                msg.prompt_logprobs.append(PromptLogprobsPart(
                    rid, chunk.start, chunk.token_ids.tolist(), chunk.logprob.tolist(), chunk.rank.tolist(),
                    chunk.topk_ids.tolist(), chunk.topk_logprobs.tolist()))
        if not produced:
            return msg
        # One entry per generated token: a fast-replay row that sampled n tokens appears n times in a row.
        starts = out.row_starts  # None: one token per row, at the row's index
        row_of = {rid: i for i, rid in enumerate(out.req_ids)} if out.logprob is not None or starts is not None else {}
        entries: list[int] = []  # index of each entry's token in the step's sampled arrays (when logprobs)
        for r in produced:
            n, first = 1, 0
            if starts is not None:
                row = row_of[r.request_id]
                n, first = r.num_new_tokens, int(starts[row])  # a speculative row is cut at a stop token
            elif row_of:
                first = row_of[r.request_id]
            msg.req_ids.extend([r.request_id] * n)
            msg.token_ids.extend(r.token_ids[-n:])
            msg.num_cached_tokens.extend([r.num_cached_tokens] * n)
            entries.extend(range(first, first + n))
        if out.logprob is not None:  # sampled entries -> entries of the message
            msg.logprob = out.logprob[entries].tolist()
            msg.rank = out.rank[entries].tolist()
            if out.topk_ids is not None:
                msg.topk_ids = out.topk_ids[entries].tolist()
                msg.topk_logprobs = out.topk_logprobs[entries].tolist()
        for r in produced:
            if r.request_id in out.full_logprobs:
                msg.full_logprobs[r.request_id] = out.full_logprobs[r.request_id].tobytes()  # [n, V]
            if r.is_finished:
                msg.finished.append((r.request_id, r.status.finish_reason, r.stop_reason))
                if r.routed_experts is not None:
                    msg.routed_experts.append(RoutedExpertsPart.of(r.request_id, r.routed_experts))
                parent = self._parent_of.get(r.request_id)
                if parent is not None:
                    parent.num_finished += 1
                    if parent.num_finished == len(parent.child_ids):
                        self.abort(parent.request_id)
        return msg
