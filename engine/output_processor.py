"""OutputProcessor: incremental detokenization, stop strings, logprobs as Python objects, RequestOutputs.

What a request gets back each step follows its `SamplingParams.output_kind`: CUMULATIVE, a snapshot of
everything so far; DELTA, only what is new since its previous output; FINAL_ONLY, nothing until it finishes
(no per-step snapshot at all: the cheap mode, used by `LLM.generate` and non-streaming server calls).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind
from ..step_io import ModelRunnerOutput, PromptLogprobsChunk
from .request import Request, RequestStatus
from .scheduler import Scheduler

if TYPE_CHECKING:
    from tokenizers.decoders import DecodeStream


@dataclass
class DeltaCursor:
    """DELTA only: how much of one completion has already been handed out."""

    num_tokens: int = 0  # token_ids (and logprobs / full_logprobs entries, one per token) sent
    num_chars: int = 0  # characters of text sent


@dataclass
class ParentState:
    """What the user asked for: one prompt with n completions (children share the prompt and its params).

    The completions here are always cumulative (stop strings search the whole text); `to_output` turns them
    into what `output_kind` asks for."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    completions: list[CompletionOutput]
    prompt_logprobs: list | None  # [None, {tok: Logprob}, ...] while being filled
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA: a running completion's last `stop_hold` (= longest stop string - 1) characters are held back, as
    # the server's streaming does: a stop string ending in a later token may still cut them, and text handed
    # out cannot be taken back. A cut never reaches further back (the stop string was not in the older text).
    stop_hold: int = 0
    num_cached_tokens: int = 0
    num_finished: int = 0
    child_ids: list[str] = field(default_factory=list)
    cursors: list[DeltaCursor] = field(default_factory=list)  # DELTA: one per completion
    prompt_logprobs_sent: bool = False  # DELTA

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.completions)

    def to_output(self) -> RequestOutput | None:
        """This step's output, per output_kind (None: FINAL_ONLY and not finished yet). It never shares a list
        that a later step appends to: outputs already handed out do not change."""
        if self.output_kind is RequestOutputKind.DELTA:
            comps = [_delta(c, cur, self.stop_hold) for c, cur in zip(self.completions, self.cursors)]
            prompt_lps = None
            # Sent once, complete: a request's first token comes after its whole prompt was prefilled, but with
            # n > 1 another child's token may trigger an output while child 0 (which fills them) is still queued.
            if (not self.prompt_logprobs_sent and self.prompt_logprobs is not None
                    and len(self.prompt_logprobs) == len(self.prompt_token_ids)):
                prompt_lps, self.prompt_logprobs_sent = list(self.prompt_logprobs), True
        elif self.finished:  # the state is dropped right after: no copy needed
            comps, prompt_lps = self.completions, self.prompt_logprobs
        elif self.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        else:
            comps = [_snapshot(c) for c in self.completions]
            prompt_lps = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), prompt_lps, comps,
                             self.finished, self.num_cached_tokens)


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    copied = copy.copy(c)
    for name, value in vars(c).items():
        if isinstance(value, list):
            setattr(copied, name, list(value))
        elif isinstance(value, FlatLogprobs):
            setattr(copied, name, value.snapshot())
    return copied


def _delta(c: CompletionOutput, cur: DeltaCursor, hold: int) -> CompletionOutput:
    """What is new in `c` since `cur`, advancing `cur`. A completion with nothing new comes back with empty
    lists; cumulative_logprob stays cumulative and finish/stop reasons are set once it has finished (as vLLM)."""
    n = cur.num_tokens
    end = len(c.text) if c.finished() else max(cur.num_chars, len(c.text) - hold)
    out = CompletionOutput(c.index, c.text[cur.num_chars:end], c.token_ids[n:], c.cumulative_logprob,
                           None if c.logprobs is None else c.logprobs[n:], c.finish_reason, c.stop_reason,
                           None if c.full_logprobs is None else c.full_logprobs[n:])
    cur.num_tokens, cur.num_chars = len(c.token_ids), end
    return out


class _StepLogprobs:
    """The step's logprob arrays as flat Python lists, converted once per step instead of once per element
    (numpy scalar reads cost ~10x a list read). Flat on purpose: `[S, K].tolist()` made S small lists per step,
    and those container allocations alone set off a garbage collection every step (measured on the H200
    host: ~1 ms a step for 256 rows with logprobs=1). S entries: one per sampled token (S == R rows unless
    fast-replay rows sampled several)."""

    def __init__(self, out: ModelRunnerOutput):
        self.logprob: list[float] = out.logprob.tolist()  # [S]
        self.rank: list[int] = out.rank.tolist()  # [S]
        has_topk = out.topk_ids is not None and out.topk_ids.shape[1] > 0
        self.k = out.topk_ids.shape[1] if has_topk else 0  # K: the widest top-k of the batch
        self.topk_ids: list[int] = out.topk_ids.ravel().tolist() if has_topk else []  # [S * K]
        self.topk_logprobs: list[float] = out.topk_logprobs.ravel().tolist() if has_topk else []  # [S * K]


@dataclass
class ChildState:
    parent: ParentState
    index: int
    stream: DecodeStream | None  # None: no detokenization
    stops: list[str]
    include_stop: bool
    num_logprobs: int | None
    full_logprobs: bool = False  # SamplingParams.return_full_logprobs


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int],
                    children: list[Request]) -> None:
        p0 = children[0].params
        delta = p0.output_kind is RequestOutputKind.DELTA
        parent = ParentState(parent_id, prompt, list(prompt_token_ids),
                             [CompletionOutput(i, "", [], None, None) for i in range(len(children))],
                             [None] if p0.prompt_logprobs is not None else None, p0.output_kind,
                             stop_hold=max(map(len, p0.stop), default=1) - 1 if delta else 0,
                             child_ids=[c.request_id for c in children],
                             cursors=[DeltaCursor() for _ in children] if delta else [])
        self.parents[parent_id] = parent
        for i, child in enumerate(children):
            p = child.params
            stream = None
            if self._backend is not None and p.detokenize:
                from tokenizers.decoders import DecodeStream

                stream = DecodeStream(skip_special_tokens=p.skip_special_tokens)
            self.children[child.request_id] = ChildState(parent, i, stream, list(p.stop),
                                                         p.include_stop_str_in_output, p.logprobs,
                                                         full_logprobs=p.return_full_logprobs)
            if p.logprobs is not None:
                parent.completions[i].logprobs = FlatLogprobs(p.logprobs, self.decode_token)
                parent.completions[i].cumulative_logprob = 0.0
            if p.return_full_logprobs:
                parent.completions[i].full_logprobs = []

    def abort(self, parent_id: str) -> ParentState | None:
        parent = self.parents.pop(parent_id, None)
        if parent is not None:
            for cid in parent.child_ids:
                self.children.pop(cid, None)
        return parent

    def process(self, produced: list[Request], out: ModelRunnerOutput, scheduler: Scheduler) -> list[RequestOutput]:
        touched: dict[str, ParentState] = {}
        for rid, chunk in out.prompt_logprobs.items():
            child = self.children.get(rid)
            if child is not None and child.index == 0:
                self._add_prompt_logprobs(child.parent, chunk)
        step_lps = _StepLogprobs(out) if out.logprob is not None else None
        starts = out.row_starts  # fast replay: rows sampled several tokens (None: one each, at the row index)
        row_of = {rid: i for i, rid in enumerate(out.req_ids)} if step_lps is not None or starts is not None else {}
        final_only = RequestOutputKind.FINAL_ONLY
        for req in produced:
            child = self.children[req.request_id]
            parent = child.parent
            comp = parent.completions[child.index]
            if child.index == 0:
                parent.num_cached_tokens = max(0, req.num_cached_tokens)
            if starts is not None and out.num_sampled[row_of[req.request_id]] > 1:
                # a fast-replay row's tokens (trace tokens: no stop string can end them early)
                row = row_of[req.request_id]
                n = int(out.num_sampled[row])
                for j, token in enumerate(req.token_ids[-n:]):
                    self._add_token(req, child, comp, token, int(starts[row]) + j, step_lps, scheduler)
            else:  # one token; inlined (this runs for every row of every step)
                token = req.token_ids[-1]
                comp.token_ids.append(token)
                if child.num_logprobs is not None:
                    index = row_of[req.request_id] if starts is None else int(starts[row_of[req.request_id]])
                    logprob = step_lps.logprob[index]
                    comp.logprobs.append_token(token, logprob, step_lps.rank[index], step_lps.topk_ids,
                                               step_lps.topk_logprobs, index * step_lps.k)
                    comp.cumulative_logprob += logprob
                if child.stream is not None:
                    self._add_text(req, child, comp, token, scheduler)
            if child.full_logprobs:
                comp.full_logprobs.extend(out.full_logprobs[req.request_id])  # [n, V]: n rows
            if req.is_finished:
                comp.finish_reason = req.status.finish_reason
                comp.stop_reason = req.stop_reason
                parent.num_finished += 1
            elif parent.output_kind is final_only:
                continue  # nothing to hand out until it finishes (the cheap mode of LLM.generate)
            touched[parent.request_id] = parent
        results = []
        for parent in touched.values():
            output = parent.to_output()
            if output is not None:
                results.append(output)
            if parent.finished:
                self.abort(parent.request_id)
        return results

    def _add_token(self, req: Request, child: ChildState, comp: CompletionOutput, token: int, index: int,
                   step_lps: _StepLogprobs | None, scheduler: Scheduler) -> None:
        """One generated token: its logprobs (entry `index` of the step's sampled arrays), text, stop strings."""
        comp.token_ids.append(token)
        if child.num_logprobs is not None:
            logprob = step_lps.logprob[index]
            comp.logprobs.append_token(token, logprob, step_lps.rank[index], step_lps.topk_ids,
                                       step_lps.topk_logprobs, index * step_lps.k)
            comp.cumulative_logprob += logprob
        if child.stream is not None:
            self._add_text(req, child, comp, token, scheduler)

    def _add_text(self, req: Request, child: ChildState, comp: CompletionOutput, token: int,
                  scheduler: Scheduler) -> None:
        delta = child.stream.step(self._backend, token) or ""
        comp.text += delta
        if child.stops and not req.is_finished and delta:
            self._check_stop_strings(req, comp, child, len(delta), scheduler)

    def _check_stop_strings(self, req: Request, comp: CompletionOutput, child: ChildState, new_chars: int,
                            scheduler: Scheduler) -> None:
        best: tuple[int, str] | None = None
        for s in child.stops:
            i = comp.text.find(s, max(0, len(comp.text) - new_chars - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return
        i, s = best
        comp.text = comp.text[: i + len(s)] if child.include_stop else comp.text[:i]
        req.stop_reason = s
        scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def decode_token(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _add_prompt_logprobs(self, parent: ParentState, chunk: PromptLogprobsChunk) -> None:
        have = len(parent.prompt_logprobs)  # entries for prompt positions 0 .. have-1
        for j in range(chunk.token_ids.shape[0]):
            pos = chunk.start + 1 + j
            if pos != have:  # recomputed after preemption, or out of order: keep the first
                continue
            tid = int(chunk.token_ids[j])
            d = {tid: Logprob(float(chunk.logprob[j]), int(chunk.rank[j]), self.decode_token(tid))}
            for m in range(chunk.topk_ids.shape[1]):
                t = int(chunk.topk_ids[j, m])
                if t not in d:
                    d[t] = Logprob(float(chunk.topk_logprobs[j, m]), m + 1, self.decode_token(t))
            parent.prompt_logprobs.append(d)
            have += 1

