"""Ground floor: the nouns that cross the engine <-> model runner boundary once per step.

`SchedulerOutput` goes down (engine/scheduler.py builds it, model_runner_v2/ consumes it); `ModelRunnerOutput`
comes back up (the runner fills it, engine/output_processor.py reads it). Imports no folder of the package
(see docs/architecture.md, "Floors")."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .reasoning import ReasoningTokens
from .sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the model runner (first time, or again after preemption): all it needs for a slot."""

    request_id: str
    token_ids: list[int]  # prompt + outputs so far (a resumed request recomputes all of them)
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams  # normalised (SamplingParams.verify_for_engine)
    seed: int
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    reasoning_tokens: ReasoningTokens | None = None  # set when params.thinking_token_budget is (its span's tokens)


@dataclass(slots=True)  # one per row per step: slots make it cheaper to build and read
class ScheduledRow:
    """One batch row: request, tokens to run this step, and the blocks it gained this step."""

    request_id: str
    num_computed_tokens: int  # before this step
    num_scheduled_tokens: int
    new_block_ids: list[int]
    # Tokens sampled at the end of this chunk: 0 (a partial prefill chunk), 1 (the chunk reaches the end of the
    # known tokens), or up to trace_replay_chunk_size for a replaying request whose chunk also carries upcoming
    # trace tokens (fast replay: the logits of its last num_sampled_tokens positions are all scored).
    num_sampled_tokens: int
    new_request: NewRequestData | None = None
    # Speculative decoding: the d tokens drafted after the request's last known token. The row then runs
    # [last, draft[0], ..., draft[d-1]] (num_scheduled_tokens = num_sampled_tokens = 1 + d) and samples all
    # 1 + d positions; the runner keeps the longest prefix whose samples equal the drafts, plus one token.
    draft_token_ids: list[int] | None = None

    @property
    def samples(self) -> bool:
        return self.num_sampled_tokens > 0


@dataclass
class GrammarBitmask:
    """Structured outputs: the tokens each grammar allows next, for the G sampling rows that have a grammar."""

    rows: np.ndarray  # [G] int64, index among the step's sampling rows (rows with num_sampled_tokens > 0)
    bitmask: np.ndarray  # [G, ceil(V/32)] int32, bit j of word i set = token 32*i + j allowed (xgrammar layout)


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    freed_request_ids: list[str] = field(default_factory=list)  # finished/preempted: runner frees slots first
    # Structured outputs, for the synchronous `RunnerInterface.execute` (the engine sets it after scheduling).
    # The async step fills the bits after `execute_model` and hands them to `sample_tokens` itself.
    grammar: GrammarBitmask | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens start+1 .. start+n (the first prompt token has none), for one chunk."""

    start: int  # position of the first scored prompt token, minus one
    token_ids: np.ndarray  # [n]
    logprob: np.ndarray  # [n]
    rank: np.ndarray  # [n]
    topk_ids: np.ndarray  # [n, k]
    topk_logprobs: np.ndarray  # [n, k]


@dataclass
class ModelRunnerOutput:
    """Host copies for the R rows that sampled this step (in batch order), S sampled tokens in all: one per row,
    except fast-replay rows, which sample `num_sampled[r]` consecutive tokens (their entries are adjacent)."""

    req_ids: list[str]  # [R]
    sampled: np.ndarray  # [S] int64
    logprob: np.ndarray | None = None  # [S] float32
    rank: np.ndarray | None = None  # [S] int64
    topk_ids: np.ndarray | None = None  # [S, K]
    topk_logprobs: np.ndarray | None = None  # [S, K]
    # return_full_logprobs rows only: request id -> [n, V] float32 raw log-softmax of its n sampled positions.
    full_logprobs: dict[str, np.ndarray] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # [R] tokens per row; None: one each (S == R, every step but fast replay and speculative steps). A speculative
    # row's count is its accepted drafts + 1 (rejected positions are already dropped from every [S] array).
    num_sampled: np.ndarray | None = None

    @property
    def row_starts(self) -> np.ndarray | None:
        """[R] index of each row's first sampled token (None when every row sampled one: the row index)."""
        if self.num_sampled is None:
            return None
        return np.cumsum(self.num_sampled) - self.num_sampled

    def sampled_by_request(self) -> dict[str, int | list[int]]:
        """Request id -> its sampled token, or its list of tokens for a row that sampled several."""
        tokens = self.sampled.tolist()
        if self.num_sampled is None:
            return dict(zip(self.req_ids, tokens))
        starts, counts = self.row_starts.tolist(), self.num_sampled.tolist()
        return {rid: tokens[s] if n == 1 else tokens[s : s + n]
                for rid, s, n in zip(self.req_ids, starts, counts)}
