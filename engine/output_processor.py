"""OutputProcessor: incremental detokenization, stop strings, logprobs as Python objects, RequestOutputs.

What a request gets back each step follows its `SamplingParams.output_kind`: CUMULATIVE, a snapshot of
everything so far; DELTA, only what is new since its previous output; FINAL_ONLY, nothing until it finishes
(no per-step snapshot at all: the cheap mode, used by `LLM.generate` and non-streaming server calls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
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
    detokenize: bool = True  # False: logprobs carry no decoded_token (vLLM's detokenize=False)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.completions)

    def to_output(self, live: bool = False) -> RequestOutput | None:
        """This step's output, per output_kind (None: FINAL_ONLY and not finished yet). It never shares a list
        that a later step appends to: outputs already handed out do not change (the prompt's ids are shared).
        `live` (CUMULATIVE only): share the completions themselves, no copy, for a consumer that reads the
        output at once and keeps nothing of it (a stream's direct sink): the per-step copy of every token id
        and logprob so far made a long stream's per-token cost grow with its length."""
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
        elif live:
            comps, prompt_lps = self.completions, self.prompt_logprobs
        else:
            comps = [_snapshot(c) for c in self.completions]
            prompt_lps = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        # prompt_token_ids is shared, not copied: nothing appends to it (a copy per streamed token of a 512-token
        # prompt was a visible share of the server's per-token cost).
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, prompt_lps, comps,
                             self.finished, self.num_cached_tokens)


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    """A copy later appends do not reach (field by field: a generic copy cost 3x this on the server's per-step
    path, one call per streaming request per step). A new CompletionOutput list field must be copied here."""
    lps = c.logprobs
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            lps.snapshot() if isinstance(lps, FlatLogprobs) else None if lps is None else list(lps),
                            c.finish_reason, c.stop_reason, None if c.full_logprobs is None else list(c.full_logprobs),
                            c.routed_experts)


def _delta(c: CompletionOutput, cur: DeltaCursor, hold: int) -> CompletionOutput:
    """What is new in `c` since `cur`, advancing `cur`. A completion with nothing new comes back with empty
    lists; cumulative_logprob stays cumulative and finish/stop reasons are set once it has finished (as vLLM)."""
    n = cur.num_tokens
    end = len(c.text) if c.finished() else max(cur.num_chars, len(c.text) - hold)
    out = CompletionOutput(c.index, c.text[cur.num_chars:end], c.token_ids[n:], c.cumulative_logprob,
                           None if c.logprobs is None else c.logprobs[n:], c.finish_reason, c.stop_reason,
                           None if c.full_logprobs is None else c.full_logprobs[n:], c.routed_experts)
    cur.num_tokens, cur.num_chars = len(c.token_ids), end
    return out


class _StepLogprobs:
    """The step's logprob arrays as flat Python lists, converted once per step instead of once per element
    (a numpy scalar read costs far more than a list read). Flat on purpose: `[S, K].tolist()` would make S small
    lists per step, and those container allocations set off a garbage collection every step (docs/benchmarks.md
    has the host cost). S entries: one per sampled token (S == R rows unless fast-replay rows sampled several)."""

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
    min_tokens: int = 0  # stop strings count only in the text after the first min_tokens tokens (vLLM's)


def ended_by_token(finish_reason: str | None, stop_reason: int | str | None) -> bool:
    """Did the last token end the sequence (EOS, a stop_token_ids id, a grammar's end)? Its text is then left out
    of the output unless include_stop_str_in_output, as vLLM's detokenizer does; its id stays in token_ids. A
    stop string (str reason, cut from the text already) or a repetition keeps the last token's text."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


class OutputProcessor:
    """Per-request output state. In process (LLMEngine) it is fed each step's produced requests; in the API
    server process (engine/core_client.py) it is fed the engine core's token messages through `append_token`,
    which is where text, stop strings and logprobs become Python objects."""

    def __init__(self, tokenizer, decode_token: Callable[[int], str | None]):
        self.tokenizer = tokenizer
        self.decode_token = decode_token  # token id -> text, cached (InputProcessor.decode_token)
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], child_ids: list[str],
                    p: SamplingParams) -> None:
        """One prompt with len(child_ids) completions, all with params p."""
        delta = p.output_kind is RequestOutputKind.DELTA
        parent = ParentState(parent_id, prompt, list(prompt_token_ids),
                             [CompletionOutput(i, "", [], None, None) for i in range(len(child_ids))],
                             [None] if p.prompt_logprobs is not None else None, p.output_kind,
                             stop_hold=max(map(len, p.stop), default=1) - 1 if delta else 0,
                             child_ids=list(child_ids), cursors=[DeltaCursor() for _ in child_ids] if delta else [],
                             detokenize=p.detokenize)
        self.parents[parent_id] = parent
        for i, child_id in enumerate(child_ids):
            stream = None
            if self._backend is not None and p.detokenize:
                from tokenizers.decoders import DecodeStream

                stream = DecodeStream(skip_special_tokens=p.skip_special_tokens)
            self.children[child_id] = ChildState(parent, i, stream, list(p.stop), p.include_stop_str_in_output,
                                                 p.logprobs, full_logprobs=p.return_full_logprobs,
                                                 min_tokens=p.min_tokens)
            if p.logprobs is not None:
                parent.completions[i].logprobs = FlatLogprobs(p.logprobs, self.decode_token if p.detokenize
                                                              else _no_text)
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
        """In process: the step's produced requests -> their outputs. Runs for every row of every step, so the
        common case (one token, no text) touches only what it needs."""
        for rid, chunk in out.prompt_logprobs.items():
            self.add_prompt_logprobs(rid, chunk)
        step_lps = _StepLogprobs(out) if out.logprob is not None else None
        starts = out.row_starts  # fast replay: rows sampled several tokens (None: one each, at the row index)
        row_of = {rid: i for i, rid in enumerate(out.req_ids)} if step_lps is not None or starts is not None else {}
        final_only = RequestOutputKind.FINAL_ONLY
        touched: dict[str, ParentState] = {}
        children, backend = self.children, self._backend
        for req in produced:
            child = children[req.request_id]
            stream = child.stream
            if starts is None and not child.full_logprobs and (stream is None or not child.stops):
                # The common row: one token, text without stop strings to search (or none). append_token's
                # bookkeeping inlined (no lp tuple, no call): it runs for every row of every step of
                # LLM.generate (the core process uses core_outputs.py).
                parent, token = child.parent, req.token_ids[-1]
                comp = parent.completions[child.index]
                if child.index == 0:
                    parent.num_cached_tokens = max(0, req.num_cached_tokens)
                comp.token_ids.append(token)
                if child.num_logprobs is not None:
                    i = row_of[req.request_id]
                    logprob = step_lps.logprob[i]
                    comp.logprobs.append_token(token, logprob, step_lps.rank[i], step_lps.topk_ids,
                                               step_lps.topk_logprobs, i * step_lps.k)
                    comp.cumulative_logprob += logprob
                if stream is not None and not (req.is_finished and not child.include_stop
                                               and ended_by_token(req.status.finish_reason, req.stop_reason)):
                    delta = stream.step(backend, token)
                    if delta:
                        comp.text += delta
            else:
                self._append_row(req, child, out, step_lps, starts, row_of, scheduler)
            if req.is_finished:
                self.finish_child(child, req.status.finish_reason, req.stop_reason)
                child.parent.completions[child.index].routed_experts = req.routed_experts
            elif child.parent.output_kind is final_only:
                continue  # nothing to hand out until it finishes (the cheap mode of LLM.generate)
            touched[child.parent.request_id] = child.parent
        return self.collect(touched.values())

    def _append_row(self, req: Request, child: ChildState, out: ModelRunnerOutput, step_lps: _StepLogprobs | None,
                    starts, row_of: dict[str, int], scheduler: Scheduler) -> None:
        """A row's tokens (several for a fast-replay row), with text, stop strings and full logprobs."""
        n, first = 1, 0
        if starts is not None:  # the tokens the scheduler appended (a speculative row stops at a stop token)
            row = row_of[req.request_id]
            n, first = req.num_new_tokens, int(starts[row])
        elif step_lps is not None:
            first = row_of[req.request_id]
        full = out.full_logprobs[req.request_id] if child.full_logprobs else None  # [n, V]
        if n > 1 and child.stream is None and full is None:
            # A fast-replay or speculative row without text: its n tokens appended in bulk (list slices, no
            # per-token call: a W2 lookahead step appends ~8,000 tokens).
            comp = child.parent.completions[child.index]
            if child.index == 0:
                child.parent.num_cached_tokens = max(0, req.num_cached_tokens)
            tokens = req.token_ids[-n:]
            comp.token_ids.extend(tokens)
            if child.num_logprobs is not None:
                logprobs = step_lps.logprob[first : first + n]
                comp.logprobs.extend_tokens(tokens, logprobs, step_lps.rank[first : first + n], step_lps.topk_ids,
                                            step_lps.topk_logprobs, first * step_lps.k, step_lps.k)
                total = comp.cumulative_logprob
                for x in logprobs:  # in order, as per-token appends would (the same float sums)
                    total += x
                comp.cumulative_logprob = total
            return
        for j, token in enumerate(req.token_ids[-n:]):
            lp = None
            if child.num_logprobs is not None:
                i = first + j
                lp = (step_lps.logprob[i], step_lps.rank[i], step_lps.topk_ids, step_lps.topk_logprobs,
                      i * step_lps.k)
            ended = req.is_finished and j == n - 1
            stop = self.append_token(child, token, req.num_cached_tokens, lp, None if full is None else full[j],
                                     ended and ended_by_token(req.status.finish_reason, req.stop_reason))
            if stop is not None:  # a stop string ended it: the scheduler frees it now
                req.stop_reason = stop
                if req.is_finished:  # in the token that also hit the length limit: the stop string wins (vLLM's)
                    req.status = RequestStatus.FINISHED_STOPPED
                scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                return  # later tokens of a speculative row are dropped, as plain decoding never made them

    def append_token(self, child: ChildState, token: int, num_cached_tokens: int,
                     lp: tuple[float, int, list[int], list[float], int] | None, full,
                     stop_token: bool = False) -> str | None:
        """One generated token of `child`. lp: (its logprob, its rank, the step's flat top-k ids and logprobs,
        where this token's k entries start in them); full: its [V] raw log-softmax. Returns the stop string the
        new text completed (text already cut), or None, also in the token that ended it by length (the stop string
        then wins, as in vLLM). `stop_token`: this token ended it (ended_by_token): no text unless include_stop."""
        comp = child.parent.completions[child.index]
        if child.index == 0:
            child.parent.num_cached_tokens = max(0, num_cached_tokens)
        comp.token_ids.append(token)
        if lp is not None:
            comp.logprobs.append_token(token, *lp)
            comp.cumulative_logprob += lp[0]
        if full is not None:
            comp.full_logprobs.append(full)
        if child.stream is not None and not (stop_token and not child.include_stop):
            delta = child.stream.step(self._backend, token) or ""
            comp.text += delta
            if child.stops and delta and len(comp.token_ids) > child.min_tokens:
                return self._check_stop_strings(comp, child, len(delta))
        return None

    @staticmethod
    def finish_child(child: ChildState, finish_reason: str, stop_reason: int | str | None) -> None:
        comp = child.parent.completions[child.index]
        comp.finish_reason, comp.stop_reason = finish_reason, stop_reason
        child.parent.num_finished += 1

    def collect(self, touched) -> list[RequestOutput]:
        """The outputs of the parents a step touched (per output_kind); finished parents are dropped."""
        results = []
        for parent in touched:
            output = parent.to_output()
            if output is not None:
                results.append(output)
            if parent.finished:
                self.abort(parent.request_id)
        return results

    @staticmethod
    def _check_stop_strings(comp: CompletionOutput, child: ChildState, new_chars: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in child.stops:
            i = comp.text.find(s, max(0, len(comp.text) - new_chars - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        comp.text = comp.text[: i + len(s)] if child.include_stop else comp.text[:i]
        return s

    def add_prompt_logprobs(self, child_id: str, chunk: PromptLogprobsChunk) -> None:
        """A chunk of prompt logprobs (completion 0 of a request fills them; others are ignored)."""
        child = self.children.get(child_id)
        if child is None or child.index != 0:
            return
        parent = child.parent
        have = len(parent.prompt_logprobs)  # entries for prompt positions 0 .. have-1
        decode = self.decode_token if parent.detokenize else _no_text
        for j in range(chunk.token_ids.shape[0]):
            pos = chunk.start + 1 + j
            if pos != have:  # recomputed after preemption, or out of order: keep the first
                continue
            tid = int(chunk.token_ids[j])
            d = {tid: Logprob(float(chunk.logprob[j]), int(chunk.rank[j]), decode(tid))}
            for m in range(chunk.topk_ids.shape[1]):
                t = int(chunk.topk_ids[j, m])
                if t not in d:
                    d[t] = Logprob(float(chunk.topk_logprobs[j, m]), m + 1, decode(t))
            parent.prompt_logprobs.append(d)
            have += 1


def _no_text(token: int) -> None:
    """detokenize=False: a logprob's decoded_token is None (vLLM's)."""
    return None
