"""Request: the scheduler's host-side state of one sequence (tokens, progress, blocks)."""

from __future__ import annotations

from enum import Enum, auto

from ..sampling_params import SamplingParams
from .block_hash import salted_root


class RequestStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED_STOPPED = auto()
    FINISHED_LENGTH = auto()
    FINISHED_ABORTED = auto()

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


_FINISHED = frozenset(s for s in RequestStatus if s.is_finished)


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The engine id of completion `index` of a request with n completions (vLLM's "{index}_{parent}")."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


class Request:
    """One sequence. `token_ids` = prompt + output; counters are stored, everything else is derived."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: tuple[int, ...], arrival: int):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed  # resolved per request: the user's seed, or one drawn from the engine's RNG
        self.eos_token_ids = eos_token_ids
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache or being written (advanced at schedule)
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained sha256 keys of this request's full blocks, computed lazily
        # Forced MoE routes (trace_routed_experts) change the K/V of the blocks they cover and of every block
        # after: such a request's hash chain starts from its routes, so it shares cached blocks only with requests
        # forcing the very same routes, and no other request reads its blocks (BlockManager).
        routes = params.trace_routed_experts
        self.block_hash_seed: bytes | None = (None if routes is None
                                              else salted_root(b"trace_routed_experts", routes))
        self.num_published_blocks = 0  # leading block_ids already offered to the prefix cache
        # Sampled tokens not yet known on the host: set when a sampling step is scheduled, cleared when its
        # result lands. 0 between steps without async scheduling; up to 2 with it (one step in flight).
        self.num_pending = 0
        self.num_new_tokens = 0  # tokens the latest Scheduler.update appended (what the outputs hand on)
        # Not structured outputs: their bitmask is needed only by the sampler, after the forward pass, and the
        # engine fills it between execute_model and sample_tokens, so their steps keep the overlap
        # (docs/structured_outputs.md).
        self._reads_host_tokens = (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                                   or params.frequency_penalty != 0.0 or bool(params.bad_words))
        # Whether needs_host_tokens can ever be true (the scheduler counts such running requests, so a batch without
        # any skips the per-step scan).
        self.may_read_host_tokens = self._reads_host_tokens or params.min_tokens > 0
        # Speculative decoding drafts only for requests whose sampling is the same at every position of a
        # verified chunk: not with penalties or bad words (they read the tokens before each position), nor a
        # grammar (its matcher must accept each token before the next mask), nor full-vocabulary logprobs (one
        # [V] row per token), nor a thinking budget (its device count advances once per draw); min_tokens below
        # its count is checked per step.
        self._may_speculate = (not self._reads_host_tokens and params.structured_outputs is None
                               and not params.return_full_logprobs and params.thinking_token_budget is None)
        # Token ids that may stop the request (EOS unless ignore_eos, stop_token_ids): the per-step stop check
        # looks a sampled token up here first, so the common "not a stop token" case is one set lookup.
        self.stop_check_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else eos_token_ids)
        # prompt + max_tokens; Scheduler.add_request caps it at max_model_len.
        self.max_total_tokens = self.num_prompt_tokens + (params.max_tokens if params.max_tokens is not None
                                                          else 1 << 62)
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling (-1: not scheduled yet)
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.bad_words_token_ids: list[list[int]] = []  # tokenized `params.bad_words` (set by the engine)
        self.reasoning_tokens = None  # ReasoningTokens, with a thinking_token_budget (set by the engine)
        # Structured outputs: the request's grammar matcher (engine/structured_output_manager.RequestGrammar, set by
        # the engine); the scheduler admits it once compiled and advances it with every token.
        self.grammar = None
        # enable_return_routed_experts: the MoE routes read back when it finished (Scheduler.on_finish)
        self.routed_experts = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED  # read per row per step: one set lookup, no enum property

    @property
    def needs_host_tokens(self) -> bool:
        """Its sampler reads its latest tokens on the host (penalties, bad words, min_tokens until reached): with
        async scheduling the engine does not launch a step ahead of the results while such a request runs."""
        return self._reads_host_tokens or self.params.min_tokens > self.num_output_tokens

    @property
    def can_speculate(self) -> bool:
        """Its decode steps may carry n-gram drafts (Scheduler._drafts); otherwise it decodes one token a step."""
        return self._may_speculate and self.params.min_tokens <= self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})")
