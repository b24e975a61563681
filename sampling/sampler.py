"""Sampler: an ordered recipe of in-place steps over fp32 logits, then trace replay, then raw logprobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.token_bitmask import token_bitmask
from ..reasoning import ReasoningTokens
from ..sampling_params import SamplingParams
from ..step_io import GrammarBitmask
from .gumbel import gumbel_noise
from .ops import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_token_mask,
    apply_top_k_top_p,
)
from .sampler_logprobs import sampler_logprobs
from .sampling_states import SamplingStates
from .staged_writes import Upload
from .thinking_budget import ThinkingBudgetState
from .trace_replay_state import TraceReplayState


@dataclass(frozen=True)
class SlotTokens:
    """The runner's per-slot token state that sampling steps read (views of its buffers, not copies): penalties
    count tokens, bad words and min_tokens look at the latest ones, the noise and the trace step are keyed on
    the position being sampled. Row = slot."""

    token_ids: torch.Tensor  # [N, L] int32 device: prompt, then generated tokens
    host_token_ids: np.ndarray  # [N, L] int32 host mirror (bad words)
    prompt_len: torch.Tensor  # [N] int32 device
    total_len: torch.Tensor  # [N] int32 device: tokens known = the position being sampled
    host_prompt_len: np.ndarray  # [N] int32 host mirror
    host_total_len: np.ndarray  # [N] int32 host mirror


@dataclass(frozen=True)
class MultiPositionRows:
    """Fast replay: the batch has rows that sample several consecutive positions (a replaying request's chunk
    [last token, trace[i], ..., trace[i+n-2]] scores trace[i .. i+n-1]). R sampled rows, S positions in all, a
    row's positions adjacent and in order; rows that sample one position have n = 1."""

    num_sampled: np.ndarray  # [R] host int64, positions per row (>= 1)
    step_offsets: torch.Tensor  # [S] int64 device: 0 .. n-1 within the row; the position sampled is total_len + it
    host_step_offsets: np.ndarray  # [S] host copy
    last: torch.Tensor  # [R] int64 device: index (in S) of each row's last position
    host_last: np.ndarray  # [R] host copy
    # Speculative decoding (instead of fast replay): [S] int64 device, the drafted token each position's sample is
    # checked against (-1 at a row's last position: nothing to check, its sample is the bonus token). Every
    # position then runs the full recipe, and the sampler says which positions are kept (SamplerOutput.accepted).
    draft_token_ids: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """Device tensors for R sampled rows; copied to the host once per step by the runner."""

    sampled: torch.Tensor  # [R] int64, final tokens (trace tokens where a trace replays); [S] with MultiPositionRows
    logprob: torch.Tensor | None  # [R] float32, raw logprob of the final token
    rank: torch.Tensor | None  # [R] int64, tokens whose raw logit is >= the token's (vLLM's rank)
    topk_ids: torch.Tensor | None  # [R, K] int64, K = largest `logprobs` in the batch
    topk_logprobs: torch.Tensor | None  # [R, K] float32 (every [R] above is [S] with MultiPositionRows)
    full_logprobs: torch.Tensor | None = None  # [F, V] float32 raw log-softmax of the F rows that asked
    full_rows: np.ndarray | None = None  # [F] host, the batch row of each full_logprobs row
    # Speculative steps: [S] bool, the positions kept (a row's accepted drafts and the token after them), and [R]
    # int64 how many per row. Rejected positions' values in the arrays above are meaningless.
    accepted: torch.Tensor | None = None
    num_accepted: torch.Tensor | None = None


class Sampler:
    """Steps run in a fixed order, each skipped when no row of the batch needs it (checked on host mirrors):
    logit_bias -> allowed_token_ids -> penalties (vLLM's order) -> min_tokens mask -> bad words -> grammar bitmask
    (structured outputs) -> greedy argmax -> temperature -> min_p -> top_k/top_p -> Gumbel sample ->
    thinking-budget overwrite (forced end token) -> trace replay overwrite -> logprobs from the raw (unmodified)
    logits.

    The sampler owns every slot's sampling state (SamplingStates, and TraceReplayState when trace replay is on),
    kept like the runner's own: `add_request` / `remove_request` stage host writes, `apply_staged_writes` copies
    them to the device once per step, before sampling."""

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device, enable_trace_replay: bool):
        self.states = SamplingStates(max_num_reqs, device)
        self.thinking = ThinkingBudgetState(max_num_reqs, device)
        # Trace replay off: no buffer exists and the kernel is never launched.
        self.trace = TraceReplayState(max_num_reqs, max_model_len, device) if enable_trace_replay else None

    # -- per-slot state ---------------------------------------------------------------------------------
    def add_request(self, slot: int, params: SamplingParams, seed: int, eos_token_ids: tuple[int, ...],
                    bad_words_token_ids: list[list[int]], reasoning: ReasoningTokens | None = None,
                    token_ids: list[int] | None = None) -> None:
        """Stage the slot's options (params already passed admission: SamplingParams.verify_for_engine).
        reasoning / token_ids (prompt + outputs so far): for thinking_token_budget's starting state."""
        self.states.add_request(slot, params, seed, eos_token_ids, bad_words_token_ids)
        self.thinking.add_request(slot, params.thinking_token_budget, reasoning, token_ids or [])
        if self.trace is not None:
            self.trace.add_request(slot, params.trace_decode_token_ids)

    def remove_request(self, slot: int) -> None:
        if self.trace is not None:
            self.trace.remove_request(slot)

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        """The staged writes onto `upload` (sampling/staged_writes.py; None: copied at once)."""
        self.states.apply_staged_writes(upload)
        self.thinking.apply_staged_writes(upload)
        if self.trace is not None:
            self.trace.apply_staged_writes(upload)

    # -- one step -----------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray,
                 tokens: SlotTokens, multi_position: MultiPositionRows | None = None,
                 grammar: GrammarBitmask | None = None) -> SamplerOutput:
        """logits [R, V] in the model's dtype, as the LM head made them (never modified); slots [R] int64 device;
        host_slots [R] numpy (the same slots); tokens: the runner's per-slot token state. With `multi_position` (fast
        replay) logits, slots and host_slots have S rows, one per sampled position: the recipe runs on each row's
        last position only (a gathered copy), the trace kernel sets every replaying position, and logprobs are
        read at all S positions from the raw logits. grammar: structured outputs' allowed-token bits for some of
        the R sampled rows (None: no row has a grammar, nothing is launched)."""
        states = self.states
        num_logprobs = states.num_logprobs[host_slots]
        full_rows = np.flatnonzero(states.full_logprobs[host_slots])  # rows with return_full_logprobs
        want_logprobs = bool((num_logprobs >= 0).any()) or full_rows.size > 0
        accepted = num_accepted = None
        if multi_position is None:
            sampled = self._sample(logits, slots, host_slots, tokens, keep_input=want_logprobs, grammar=grammar)
            self.thinking.apply(sampled, slots, host_slots)
            offsets = None
        elif multi_position.draft_token_ids is not None:
            # Speculative verification: every position samples as plain decoding would at that position (same
            # recipe, same (seed, position) noise), so a draft is accepted exactly when it equals that sample.
            # A structured request never carries drafts either: its grammar row (among the R rows) is one position.
            spec_grammar = None if grammar is None else dataclasses.replace(grammar,
                                                                            rows=multi_position.host_last[grammar.rows])
            sampled = self._sample(logits, slots, host_slots, tokens, keep_input=want_logprobs,
                                   step_offsets=multi_position.step_offsets, grammar=spec_grammar)
            # A budgeted request never carries drafts (Request.can_speculate): its one position is its row's last.
            last = multi_position.last
            drawn = sampled[last]
            self.thinking.apply(drawn, slots[last], host_slots[multi_position.host_last])
            sampled[last] = drawn
            accepted, num_accepted = verify_drafts(sampled, multi_position)
            offsets = multi_position.step_offsets
        else:
            # Earlier positions of a chunk are replaying positions: the trace kernel sets them (every sampling
            # option is inert for a trace), so only each row's last position goes through the recipe.
            last = multi_position.last
            sampled = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
            last_slots, host_last_slots = slots[last], host_slots[multi_position.host_last]
            drawn = self._sample(logits[last], last_slots, host_last_slots, tokens, keep_input=False,
                                 grammar=grammar)
            self.thinking.apply(drawn, last_slots, host_last_slots)
            sampled[last] = drawn
            offsets = multi_position.step_offsets
        if self.trace is not None:
            self.trace.apply(sampled, slots, tokens.total_len, tokens.prompt_len, host_slots, offsets)
        if not want_logprobs:
            return SamplerOutput(sampled, None, None, None, None, accepted=accepted, num_accepted=num_accepted)
        return SamplerOutput(sampled, *sampler_logprobs(logits, sampled, int(num_logprobs.max()), full_rows),
                             accepted=accepted, num_accepted=num_accepted)

    def _sample(self, logits: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray, tokens: SlotTokens,
                keep_input: bool, step_offsets: torch.Tensor | None = None,
                grammar: GrammarBitmask | None = None) -> torch.Tensor:
        """The recipe up to the draw: [R] int64 tokens (replaying rows: argmax, overwritten by the trace kernel).
        keep_input: the caller reads `logits` afterwards (raw logprobs), so edits go to a copy. step_offsets [R]
        (speculative rows): row r samples position total_len + step_offsets[r] (its noise is keyed on that)."""
        states = self.states
        penalties = (_any(states.repetition_penalty.host[host_slots] != 1.0)
                     or _any(states.presence_penalty.host[host_slots])
                     or _any(states.frequency_penalty.host[host_slots]))
        logit_bias = states.logit_bias
        biased = _any(logit_bias.num_bias.host[host_slots]) or _any(logit_bias.num_allowed.host[host_slots])
        rows, toks = self._host_masks(host_slots, tokens)
        temperature = states.temperature.host[host_slots]
        greedy = temperature == 0.0
        if self.trace is not None:
            # A replaying row's token is overwritten by the trace kernel below: skip sampling it.
            greedy = greedy | self.trace.has_trace[host_slots]
        # Raw logprobs come from the untouched logits: reported numbers are the model's own. The steps below work
        # on an fp32 copy when they edit logits in place (penalties, bias/allowed ids, masks, every row sampling)
        # or sample at all (temperature and noise in fp32); a batch of greedy / trace rows makes no copy: argmax
        # and the logprobs kernel read the model-dtype logits directly (an exact upcast: the same numbers).
        edits_in_place = penalties or biased or bool(rows) or grammar is not None or not greedy.any()
        if logits.dtype != torch.float32 and (edits_in_place or not greedy.all()):
            logits = logits.float()  # [R, V] fp32 work copy
        elif edits_in_place and keep_input:
            logits = logits.clone()

        if biased:  # before the penalties, as vLLM: a seen token's biased logit is divided by repetition_penalty
            self._apply_logit_bias(logits, slots, host_slots)
        if penalties:
            max_len = int(tokens.host_total_len[host_slots].max())
            apply_penalties(logits, tokens.token_ids[slots, :max_len], tokens.prompt_len[slots],
                            tokens.total_len[slots], states.repetition_penalty.tensor[slots],
                            states.frequency_penalty.tensor[slots], states.presence_penalty.tensor[slots])
        apply_token_mask(logits, rows, toks)
        if grammar is not None:
            # One host->device copy of the [G, ceil(V/32)] bits and one launch for every structured row.
            device = logits.device
            token_bitmask(logits, torch.from_numpy(grammar.rows).to(device, non_blocking=True),
                          torch.from_numpy(grammar.bitmask).to(device, non_blocking=True))

        if greedy.all():
            return logits.argmax(dim=-1)
        positions = tokens.total_len[slots].long()  # [R] the position each row samples
        if step_offsets is not None:
            positions = positions + step_offsets
        return self._random_sample(logits, slots, host_slots, greedy, positions)

    def _random_sample(self, logits: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray,
                       greedy: np.ndarray, positions: torch.Tensor) -> torch.Tensor:
        """Greedy rows take the argmax; only the other rows pay for temperature, filters and noise."""
        states = self.states
        if greedy.any():
            sampled = logits.argmax(dim=-1)
            rows = torch.from_numpy(np.flatnonzero(~greedy)).to(logits.device, non_blocking=True)
            sub, sub_slots, host_sub = logits[rows], slots[rows], host_slots[~greedy]  # [S, V] copy
            positions = positions[rows]
        else:
            sampled, rows, sub, sub_slots, host_sub = None, None, logits, slots, host_slots
        sub.div_(states.temperature.tensor[sub_slots][:, None])
        if _any(states.min_p.host[host_sub]):
            apply_min_p(sub, states.min_p.tensor[sub_slots])
        use_k = _any(states.top_k.host[host_sub])
        use_p = _any(states.top_p.host[host_sub] < 1.0)
        if use_k or use_p:
            apply_top_k_top_p(sub, states.top_k.tensor[sub_slots] if use_k else None,
                              states.top_p.tensor[sub_slots] if use_p else None)
        # The noise is a function of (seed, position being sampled) only, never of the batch.
        sub.add_(gumbel_noise(states.seed.tensor[sub_slots], positions, sub.shape[-1]))
        if sampled is None:
            return sub.argmax(dim=-1)
        sampled[rows] = sub.argmax(dim=-1)
        return sampled

    def _apply_logit_bias(self, logits: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray) -> None:
        """logit_bias, then allowed_token_ids: one scatter each over the batch's padded slot rows, cut to the
        longest row in use. Rows that use neither see no change."""
        logit_bias = self.states.logit_bias
        num_bias = logit_bias.num_bias.host[host_slots]
        if _any(num_bias):  # else: no request uses logit_bias, skip
            width = int(num_bias.max())
            apply_logit_bias(logits, logit_bias.bias_token_ids.tensor[slots, :width],
                             logit_bias.bias_values.tensor[slots, :width], logit_bias.num_bias.tensor[slots])
        num_allowed = logit_bias.num_allowed.host[host_slots]
        if _any(num_allowed):  # else: no request uses allowed_token_ids, skip
            width = int(num_allowed.max())
            apply_allowed_token_ids(logits, logit_bias.allowed_token_ids.tensor[slots, :width],
                                    logit_bias.num_allowed.tensor[slots])

    def _host_masks(self, host_slots: np.ndarray, tokens: SlotTokens) -> tuple[list[int], list[int]]:
        """(row, token) pairs to ban this step: stop ids under min_tokens, and bad words whose prefix matches
        the end of the output. Host-side: both depend on small per-request lists."""
        states = self.states
        total_len, prompt_len = tokens.host_total_len, tokens.host_prompt_len
        rows: list[int] = []
        toks: list[int] = []
        for row in np.flatnonzero(states.min_tokens[host_slots] > 0):
            slot = host_slots[row]
            if total_len[slot] - prompt_len[slot] < states.min_tokens[slot]:
                rows += [int(row)] * len(states.stop_ids[slot])
                toks += states.stop_ids[slot]
        host_token_ids = tokens.host_token_ids
        for row in np.flatnonzero(states.has_bad_words[host_slots]):
            slot = host_slots[row]
            total, prompt = int(total_len[slot]), int(prompt_len[slot])
            for n, by_prefix in states.bad_words[slot].items():  # n: tokens before a word's last one
                if total - prompt < n:
                    continue
                last = by_prefix.get(tuple(host_token_ids[slot, total - n : total].tolist()) if n else ())
                if last:
                    rows += [int(row)] * len(last)
                    toks += last
        return rows, toks


def verify_drafts(sampled: torch.Tensor, multi_position: MultiPositionRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rows: keep each row's positions up to and including its first sample that differs from
    the draft fed after it (the last position has no draft: always a stop). sampled [S] int64 -> (kept [S] bool,
    kept per row [R] int64), on the device, no host sync. With the Gumbel-max draw this is exact rejection
    sampling for a point-mass (n-gram) draft x: x is accepted with probability p(x), and a rejected position's
    sample is distributed as p with x removed, renormalised."""
    miss = (sampled != multi_position.draft_token_ids).long()  # [S]; 1 at every row's last position
    miss_before = torch.cumsum(miss, 0) - miss  # [S] misses strictly before each position, over the batch
    first = torch.arange(sampled.shape[0], device=sampled.device) - multi_position.step_offsets  # [S] row start
    kept = miss_before == miss_before[first]  # no miss between the row start and this position
    counts = torch.cumsum(kept.long(), 0)  # [S]
    last = multi_position.last
    num_kept = counts[last] - counts[first[last]] + kept[first[last]].long()  # [R]
    return kept, num_kept


def _any(values: np.ndarray) -> bool:
    return bool(np.any(values))
