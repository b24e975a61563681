"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption by recompute."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from ..repetition_detection import REPETITION_STOP_REASON, has_repeated_tail
from ..speculative_config import SpeculativeConfig
from ..step_io import NewRequestData, ScheduledRow, SchedulerOutput
from .block_manager import BlockManager
from .ngram_proposer import NgramProposer
from .request import Request, RequestStatus
from .spec_decode_stats import SpecDecodeStats
from .structured_output_manager import accept_tokens

logger = logging.getLogger(__name__)

# Fast replay scores every position of a lookahead chunk, so a step's logits grow to [positions, V]: positions are
# bounded by the step's token budget (max_num_batched_tokens), which the runner's activation reserve covers
# (model_runner_v2/kv_cache.py). Lookahead is granted at any batch size, up to that budget: a lookahead step runs
# eagerly, and its fixed cost is spread over more tokens the bigger the step, so fewer, bigger steps win (the
# policy's numbers: docs/benchmarks.md, "W2 and the fast-replay policy").


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool,
                 speculative_config: SpeculativeConfig | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._num_host_readers = 0  # running requests with may_read_host_tokens (running_needs_host_tokens)
        self.requests: dict[str, Request] = {}
        self._freed: list[str] = []  # slots the runner must release at the next step
        self.num_preemptions = 0
        self.num_new_tokens = 0  # tokens the latest update appended (several per fast-replay or speculative row)
        # Speculative decoding (n-gram): drafts for decoding requests, and the acceptance counters.
        self.proposer = NgramProposer(speculative_config) if speculative_config is not None else None
        # Called with a running request that finishes (not aborted) before its blocks are freed: the engine reads
        # its routed experts through its block table there (enable_return_routed_experts). None: nothing.
        self.on_finish: Callable[[Request], None] | None = None
        self.spec_stats = SpecDecodeStats(speculative_config.num_speculative_tokens if speculative_config else 0)

    def add_request(self, req: Request) -> None:
        req.max_total_tokens = min(req.max_total_tokens, self.max_model_len)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def running_needs_host_tokens(self) -> bool:
        """Whether a running request's sampler reads its latest tokens on the host now (Request.needs_host_tokens);
        no per-row scan when no running request ever can (the common batch)."""
        return self._num_host_readers > 0 and any(r.needs_host_tokens for r in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget, preempted = self._schedule_running(out.rows, self.max_num_batched_tokens)
        if not preempted:  # a step that had to preempt admits no waiting request
            self._schedule_waiting(out.rows, budget)
        out.freed_request_ids, self._freed = self._freed, []
        return out

    def _schedule_running(self, rows: list[ScheduledRow], budget: int) -> tuple[int, bool]:
        """Running requests first (decodes and unfinished prefill chunks), in arrival order, preempting the latest
        arrivals when blocks run out. Returns the token budget left and whether anyone was preempted.
        This loop runs for every decoding row of every step: it reads counters directly, not via properties."""
        preempted = False
        i = 0
        running, block_size = self.running, self.block_manager.block_size
        while i < len(running) and budget > 0:
            req = running[i]
            known = len(req.token_ids) + req.num_pending  # tokens sampled so far, counting those in flight
            if req.num_pending and known >= req.max_total_tokens:
                i += 1  # its last token is still in flight (async scheduling): it finishes when that lands
                continue
            num_new = min(known - req.num_computed_tokens, budget)
            samples = req.num_computed_tokens + num_new == known
            lookahead, drafts = 0, None
            if samples and num_new == 1 and self.proposer is not None and req.can_speculate:  # a decode step
                drafts = self._drafts(req, known, budget - num_new, reserved_blocks=len(running) - i - 1)
                lookahead = len(drafts)
                num_new += lookahead
            elif samples and req.params.trace_replay_chunk_size:  # a replaying request's decode step
                # Keep one token of budget and one free block for each later running request's next token, so a
                # lookahead neither starves nor preempts the rows behind it.
                later = len(running) - i - 1
                lookahead = self._replay_lookahead(req, num_new, budget - num_new - later, reserved_blocks=later)
                num_new += lookahead
            num_old_blocks = len(req.block_ids)
            if req.num_computed_tokens + num_new > num_old_blocks * block_size:  # the last block is full
                while not self.block_manager.allocate_slots(req, num_new):
                    victim = running.pop()  # lowest priority: the latest arrival
                    self._num_host_readers -= victim.may_read_host_tokens
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                if req.status is not RequestStatus.RUNNING:
                    break  # req itself was preempted: nothing later in `running` is left either
            row = self._row(req, num_new, num_old_blocks, samples + lookahead)
            if lookahead and drafts:
                row.draft_token_ids = drafts
            rows.append(row)
            budget -= num_new
            i += 1
        return budget, preempted

    def _schedule_waiting(self, rows: list[ScheduledRow], budget: int) -> None:
        """Waiting requests, in arrival order, while the budget, max_num_seqs and the free blocks allow; structured
        requests whose grammar is not compiled yet are passed over and stay at the front."""
        compiling: list[Request] = []  # passed over this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted while its token was in flight: it resumes once that token has landed
            if req.grammar is not None and (not req.grammar.ready or req.grammar.error is not None):
                compiling.append(self.waiting.popleft())  # failed: LLMEngine fails it before the next schedule
                continue
            hits = self.block_manager.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            remaining = req.num_tokens - req.num_computed_tokens - len(hits) * self.block_manager.block_size
            if not self.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.block_manager.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(hits) * self.block_manager.block_size
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._num_host_readers += req.may_read_host_tokens
            row = self._row(req, num_new, 0, int(req.num_computed_tokens + num_new == req.num_tokens))
            row.new_request = NewRequestData(req.request_id, list(req.token_ids), req.num_prompt_tokens,
                                             list(req.block_ids), req.params, req.seed,
                                             req.bad_words_token_ids, req.reasoning_tokens)
            rows.append(row)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))  # back in arrival order, at the front

    def _row(self, req: Request, num_new: int, num_old_blocks: int, num_sampled: int) -> ScheduledRow:
        """The row, and the request's progress advanced as if the step had run: the next schedule may come
        before this step's results (async scheduling), and must not schedule the same tokens again."""
        row = ScheduledRow(req.request_id, req.num_computed_tokens, num_new, req.block_ids[num_old_blocks:],
                           num_sampled)
        req.num_computed_tokens += num_new
        req.num_pending += num_sampled
        return row

    def _replay_lookahead(self, req: Request, num_new: int, budget: int, reserved_blocks: int) -> int:
        """Fast replay: upcoming trace tokens appended to a replaying request's chunk that reaches the end of its
        known tokens (its decode step). The chunk [last token, trace[i], ..., trace[i+m-1]] then samples m + 1
        tokens, the trace's by rule. At most trace_replay_chunk_size - 1, the trace tokens left after this step's
        first one, `budget`, and what the free blocks but `reserved_blocks` hold now (a lookahead never preempts)."""
        k = req.params.trace_replay_chunk_size
        left = req.params.max_tokens - req.num_output_tokens - req.num_pending - 1
        bs = self.block_manager.block_size
        free = max(0, self.block_manager.num_free_blocks - reserved_blocks)
        room = (len(req.block_ids) + free) * bs - req.num_computed_tokens - num_new
        return max(0, min(k - 1, left, budget, room))

    def _drafts(self, req: Request, known: int, budget: int, reserved_blocks: int) -> list[int]:
        """Speculative decoding: n-gram drafts to verify in this decode step, at most what the token budget left
        after its first token, the request's max_tokens / max_model_len (the last sampled token must still fit) and
        the free blocks but `reserved_blocks` allow (drafts never preempt anyone)."""
        bs = self.block_manager.block_size
        free = max(0, self.block_manager.num_free_blocks - reserved_blocks)
        room = (len(req.block_ids) + free) * bs - req.num_computed_tokens - 1  # after the step's first token
        limit = min(budget, req.max_total_tokens - known - 1, room)
        return self.proposer.propose(req.token_ids, limit) if limit > 0 else []

    def _preempt(self, req: Request) -> None:
        self.block_manager.free_request(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._freed.append(req.request_id)

    def return_freed(self, request_ids: list[str]) -> None:
        """Slots a schedule handed out to free that will not reach the runner with it (an early schedule that came
        out empty): the next schedule hands them out again."""
        self._freed[:0] = request_ids

    def update(self, sched: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """After a step: append sampled tokens, publish full blocks to the prefix cache, apply token-based stop
        rules (progress was advanced when the step was scheduled). `sampled` maps a request to its token, or to
        its list of tokens when its row sampled several (ModelRunnerOutput.sampled_by_request). Returns the
        requests that produced tokens this step (finished ones included). Rows of requests finished or aborted
        since the step was scheduled are dropped; a request preempted while its tokens were in flight still
        gets them."""
        produced = []
        self.num_new_tokens = 0
        structured: list[Request] = []  # rows whose grammar accepts its token (one batched call, below)
        requests, running = self.requests, RequestStatus.RUNNING
        cache_full_blocks = self.block_manager.cache_full_blocks
        for row in sched.rows:
            req = requests.get(row.request_id)
            if req is None:
                continue
            if req.status is running:
                cache_full_blocks(req)
            if not row.samples or not req.num_pending:
                continue
            n = row.num_sampled_tokens
            req.num_pending -= n
            self.num_new_tokens += n
            produced.append(req)
            if row.draft_token_ids:
                self._append_verified(req, row, sampled[row.request_id])
            elif n == 1:
                req.num_new_tokens = 1
                token = sampled[row.request_id]
                req.token_ids.append(token)
                if req.grammar is not None:
                    if req.grammar.waits_for is None:
                        structured.append(req)
                        continue
                    if token == req.grammar.waits_for:  # the reasoning ended: the grammar constrains what follows
                        req.grammar.waits_for = None
                self._check_stop(req, token)
            else:  # a fast-replay chunk: trace tokens, whose EOS / stop ids are off; only the length can stop it
                tokens = sampled[row.request_id]
                req.num_new_tokens = len(tokens)
                req.token_ids.extend(tokens)
                self._check_stop(req, tokens[-1])
        if structured:
            self._advance_grammars(structured)
        return produced

    def _append_verified(self, req: Request, row: ScheduledRow, tokens: int | list[int]) -> None:
        """A speculative row's accepted drafts + the target's own next token: roll the request's progress back
        over the rejected positions (their K/V is overwritten by later steps; the blocks stay the request's
        until it finishes), then append token by token, stopping at the first EOS / stop id / length limit."""
        tokens = [tokens] if isinstance(tokens, int) else tokens
        num_drafts = len(row.draft_token_ids)
        self.spec_stats.observe(num_drafts, len(tokens) - 1)
        req.num_computed_tokens -= row.num_sampled_tokens - len(tokens)
        self.num_new_tokens -= row.num_sampled_tokens
        appended = 0
        for token in tokens:
            req.token_ids.append(token)
            appended += 1
            self._check_stop(req, token)
            if req.is_finished:
                break
        req.num_new_tokens = appended
        self.num_new_tokens += appended

    def _advance_grammars(self, reqs: list[Request]) -> None:
        """Structured outputs: each request's grammar accepts its new (last) token, all in one xgrammar call; a
        grammar that has ended (it accepted a stop token, which the bitmask allows only where the grammar may
        end) finishes its request like EOS; the others go through the usual stop checks."""
        tokens = [req.token_ids[-1] for req in reqs]
        for req, token, accepted in zip(reqs, tokens, accept_tokens([r.grammar for r in reqs], tokens)):
            if accepted and not req.grammar.ended_by(token):
                self._check_stop(req, token)
                continue
            if not accepted:  # the bitmask forbade it: never expected; stop rather than emit past the grammar
                logger.warning("request %s: token %d rejected by its grammar; stopping it", req.request_id, token)
            self.finish(req, RequestStatus.FINISHED_STOPPED)

    def _check_stop(self, req: Request, token: int) -> None:
        if token not in req.stop_check_ids:  # most tokens: only the length limit (or a repetition) can finish it
            if len(req.token_ids) >= req.max_total_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
            elif req.params.repetition_detection is not None:
                self._check_repetition(req)
            return
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            eos = not p.ignore_eos and token in req.eos_token_ids
            # vLLM's order: the tokenizer's EOS (the first) reports None even when stop_token_ids lists it; then the
            # stop ids (generation_config.json's other EOS ids are among them: they report their id)
            if eos and (token == req.eos_token_ids[0] or token not in p.stop_token_ids):
                return self.finish(req, RequestStatus.FINISHED_STOPPED)
            if token in p.stop_token_ids:
                req.stop_reason = token
                return self.finish(req, RequestStatus.FINISHED_STOPPED)
        if len(req.token_ids) >= req.max_total_tokens:
            self.finish(req, RequestStatus.FINISHED_LENGTH)
        elif req.params.repetition_detection is not None:
            self._check_repetition(req)

    def _check_repetition(self, req: Request) -> None:
        """vLLM's order: after EOS, stop ids and the length limit, and not before min_tokens. Only the output's tail
        is read (repetition_detection.has_repeated_tail: bounded by the pattern sizes, not the output length)."""
        n = req.num_output_tokens
        if n >= req.params.min_tokens and has_repeated_tail(req.token_ids, n, req.params.repetition_detection):
            req.stop_reason = REPETITION_STOP_REASON
            self.finish(req, RequestStatus.FINISHED_STOPPED)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request: free its blocks now; the runner frees its slot at the next step."""
        if req.is_finished:
            return
        was_running = req.status is RequestStatus.RUNNING
        if was_running and self.on_finish is not None and status is not RequestStatus.FINISHED_ABORTED:
            self.on_finish(req)
        if was_running:
            self.running.remove(req)
            self._num_host_readers -= req.may_read_host_tokens
            self._freed.append(req.request_id)
        else:
            self.waiting.remove(req)
        self.block_manager.free_request(req)
        if req.grammar is not None:
            req.grammar.release()  # a compile no other request waits for is stopped
        req.status = status
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
