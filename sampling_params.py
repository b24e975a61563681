"""SamplingParams: vLLM-compatible per-request sampling options, validated once (trace rules: trace_rules.py)."""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .beam_search_params import BeamSearchParams  # noqa: F401  (vLLM's import path)
from .context_limits import prompt_too_long
from .param_checks import (
    clamp_logit_bias,
    enum_field,
    id_list,
    int_field,
    is_int,
    logit_bias_field,
    real_field,
    str_list,
)
from .repetition_detection import RepetitionDetectionParams
from .routing_replay import RouteShape, check_routes, coerce_routes
from .structured_outputs import StructuredOutputsParams
from .trace_rules import PARAM_OPTIONS, apply_request_rules, check_chunk_size_needs_trace, check_engine, fit

logger = logging.getLogger(__name__)

# Same constants as vLLM: below _SAMPLING_EPS the request is greedy; temperatures in (0, _MIN_TEMP) are raised
# to _MIN_TEMP (with a warning) because dividing logits by them overflows to inf/nan.
_SAMPLING_EPS = 1e-5
_MIN_TEMP = 1e-2
# torch.Generator.manual_seed accepts exactly this range; checking here turns a late RuntimeError into a 400.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_BOOL_FIELDS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                "include_stop_str_in_output", "return_full_logprobs")
_PLAIN = (bool, int, float, str, bytes)  # immutable values a clone may share


class SamplingType(enum.IntEnum):
    """How the sampler picks a token for a request (same members as vLLM)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.IntEnum):
    """Which outputs the engine returns for a request (same members and values as vLLM)."""

    CUMULATIVE = 0  # every step: everything generated so far
    DELTA = 1  # every step: only what is new since this request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes (offline generate, non-streaming server calls)




@dataclass
class SamplingParams:
    """Per-request sampling options; names, defaults and meaning follow vLLM's SamplingParams.

    `trace_decode_token_ids` (replayllm's extension) forces the decoded tokens: the engine emits exactly
    these ids and reports each one's logprob/rank under the model's unmodified logits. With a trace,
    `max_tokens` becomes the trace length, EOS and stop conditions are ignored (cleared here), and options
    that would change which token is chosen are rejected rather than silently overridden (trace_rules.py).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len, resolved by verify_for_engine
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # added to those logits before temperature and the penalties
    allowed_token_ids: list[int] | None = None  # every other token is masked out (-inf); must not be empty
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's: JSON schema / regex / choice / grammar
    # Stop when the output ends in a pattern repeated min_count times (finish_reason "stop", stop_reason
    # "repetition_detected"); a dict of its fields is accepted too. See repetition_detection.py.
    repetition_detection: RepetitionDetectionParams | None = None
    # At most this many tokens between the reasoning start and end tokens (<think> / </think>), then the end token
    # is forced (sampling/thinking_budget.py); -1 or None: unlimited.
    thinking_token_budget: int | None = None
    trace_decode_token_ids: list[int] | None = None
    # replayllm extension (fast replay): trace tokens fed per step in the decode phase, overriding the engine's
    # `trace_replay_chunk_size` for this request (None: the engine's; 1: one token per step). Only with a trace.
    trace_replay_chunk_size: int | None = None
    # replayllm extension: also return the raw log-softmax over the whole vocabulary ([V] float32) for every
    # generated token, as `CompletionOutput.full_logprobs` (used by `replayllm diff --full-vocab` for exact KL).
    return_full_logprobs: bool = False
    # replayllm extension (routing replay, docs/moe.md; MoE models): the experts to route positions 0 .. P-1 to,
    # int array-like [P, num_layers, top_k] as CompletionOutput.routed_experts (dense layers' rows -1). Those
    # positions use these ids instead of the router's top-k, weighted by the router's own probabilities of them;
    # later positions route normally. Any request may carry them (no trace or enable_trace_replay needed).
    # Stored as an int16 numpy copy.
    trace_routed_experts: Any = field(default=None, compare=False)  # compared in __eq__ (a numpy array)
    # vLLM's: do not reuse cached KV blocks for this request's prompt, compute all of it (None: resolved per
    # request by verify_for_engine: True with prompt_logprobs, and with a trace or forced routes outside
    # batch-invariant mode, so a replay computes its prompt as the sampling run did whatever is cached; False
    # otherwise).
    skip_reading_prefix_cache: bool | None = None
    # vLLM's: keep only the prompt's last k tokens (left truncation), k < max_model_len; -1: the most a prompt may
    # have (max_model_len - 1, one position left to generate); None: no truncation (a longer prompt is an error).
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # vLLM's: which outputs the engine returns

    def __eq__(self, other: object) -> bool:
        """The dataclass comparison of every other field, plus the routes by value (a numpy array's `==` is
        elementwise, which the generated comparison cannot use)."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        a, b = self.trace_routed_experts, other.trace_routed_experts
        same_routes = a is b or (a is not None and b is not None and np.array_equal(a, b))
        return same_routes and self._compared() == other._compared()

    def _compared(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if f.compare)

    def __post_init__(self) -> None:
        self._validate_fields()
        try:  # first: -1 / max_pattern_size 0 mean "off", no conflict with a trace
            self._validate_reasoning_fields()
        except ValueError:  # with a trace, any value left is a conflict: reported as such below
            if not self.has_trace:
                raise
        if self.has_trace:
            self._apply_trace_rules()
        else:
            check_chunk_size_needs_trace(self.trace_replay_chunk_size)
        # Cross-field checks run after trace normalisation, which resets min_tokens and clears stop.
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (set detokenize=True to use stop)")
        if 0 < self.temperature < _MIN_TEMP:
            logger.warning("temperature %s is below %s, which may produce inf/nan logits; raised to %s",
                           self.temperature, _MIN_TEMP, _MIN_TEMP)
            self.temperature = _MIN_TEMP
        if self.temperature < _SAMPLING_EPS:
            # Greedy: truncation knobs cannot change the argmax; reset them so the sampler can skip them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _validate_fields(self) -> None:
        self.n = int_field("n", self.n, 1)
        self.temperature = real_field("temperature", self.temperature, 0.0, math.inf)
        self.top_p = real_field("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0  # vLLM accepts -1 as "disabled" too
        self.top_k = int_field("top_k", self.top_k, 0)
        self.min_p = real_field("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = real_field("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = real_field("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = real_field("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                                              lo_open=True)
        self.max_tokens = int_field("max_tokens", self.max_tokens, 1, allow_none=True)
        if not (self.truncate_prompt_tokens is None or (is_int(self.truncate_prompt_tokens)
                                                        and (self.truncate_prompt_tokens == -1
                                                             or self.truncate_prompt_tokens >= 1))):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, -1 (the model's limit) or None, got "
                             f"{self.truncate_prompt_tokens!r}")
        self.min_tokens = int_field("min_tokens", self.min_tokens, 0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if not (is_int(value) and value == -1):  # vLLM's -1: the whole vocabulary (verify_for_engine resolves it)
                setattr(self, name, int_field(name, value, 0, allow_none=True))
        if is_int(self.seed) and self.seed == -1:
            self.seed = None  # OpenAI clients send -1 for "no seed", as vLLM accepts
        if self.seed is not None and not (is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [{_SEED_MIN}, {_SEED_MAX}], "
                             f"got {self.seed!r}")
        self.seed = None if self.seed is None else int(self.seed)
        self.stop = str_list("stop", self.stop)
        self.bad_words = str_list("bad_words", self.bad_words)
        self.stop_token_ids = id_list("stop_token_ids", self.stop_token_ids)
        if self.trace_routed_experts is not None:
            self.trace_routed_experts = coerce_routes(self.trace_routed_experts)
        if self.skip_reading_prefix_cache is not None and not isinstance(self.skip_reading_prefix_cache, bool):
            raise ValueError(f"skip_reading_prefix_cache must be a bool or None, got "
                             f"{self.skip_reading_prefix_cache!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self.output_kind = enum_field("output_kind", self.output_kind, RequestOutputKind)
        self.logit_bias = logit_bias_field(self.logit_bias)
        if self.structured_outputs is not None and not self.has_trace:  # with a trace: the conflict is the error
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.allowed_token_ids is not None:
            # An empty list would mask every token (vLLM rejects it too).
            self.allowed_token_ids = id_list("allowed_token_ids", self.allowed_token_ids, allow_empty=False)

    def _validate_reasoning_fields(self) -> None:
        """thinking_token_budget and repetition_detection, normalised (-1, max_pattern_size 0: None, off)."""
        budget = self.thinking_token_budget
        if is_int(budget) and budget == -1:
            budget = None  # vLLM: -1 = unlimited
        if budget is not None and not (is_int(budget) and budget >= 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, or -1 / None for unlimited, got "
                             f"{budget!r}")
        self.thinking_token_budget = None if budget is None else int(budget)
        if self.repetition_detection is not None:
            rd = RepetitionDetectionParams.coerce(self.repetition_detection)
            self.repetition_detection = rd if rd.enabled else None  # max_pattern_size=0: off

    def _apply_trace_rules(self) -> None:
        """The trace's ids as a list of token ids, then its rules (trace_rules.py)."""
        self.trace_decode_token_ids = id_list("trace_decode_token_ids", self.trace_decode_token_ids,
                                               allow_empty=False)
        self.trace_replay_chunk_size = int_field("trace_replay_chunk_size", self.trace_replay_chunk_size, 1,
                                                  allow_none=True)
        apply_request_rules(self, {name: getattr(self, name) for name in PARAM_OPTIONS})

    @property
    def has_trace(self) -> bool:
        return self.trace_decode_token_ids is not None

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type is SamplingType.GREEDY

    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's: a None argument takes the field's default (max_tokens=None stays None: up to the context);
        logit_bias clamped to [-100, 100]."""
        if isinstance(kwargs.get("logit_bias"), dict):
            kwargs["logit_bias"] = clamp_logit_bias(kwargs["logit_bias"])
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"})

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one, so engine-side edits never reach the caller's
        object: lists and dicts of plain values (trace ids, stop strings, logit_bias) become new containers,
        anything else mutable is deep-copied. Plain containers are copied shallowly because they hold only
        immutable values, and a deepcopy would visit every id of a long trace on the engine's admission path."""
        new = copy.copy(self)
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value):
                setattr(new, f.name, list(value))
            elif isinstance(value, dict) and all(isinstance(v, _PLAIN) for v in value.values()):
                setattr(new, f.name, dict(value))
            elif value is not None and not isinstance(value, (*_PLAIN, enum.Enum)):
                setattr(new, f.name, copy.deepcopy(value))
        return new

    def verify_for_engine(self, *, prompt_len: int, max_model_len: int, vocab_size: int, max_logprobs: int,
                          enable_trace_replay: bool, trace_replay_chunk_size: int = 1,
                          speculative: bool = False, batch_invariant: bool = False,
                          route_shape: RouteShape | None = None) -> SamplingParams:
        """Check these params against one prompt and the engine's limits; return a resolved COPY.

        The copy has `max_tokens` resolved (None -> room left in the context, and never more than that room),
        the trace truncated to fit `max_model_len` and, with a trace, `trace_replay_chunk_size` resolved (None ->
        the engine's `trace_replay_chunk_size`) and `skip_reading_prefix_cache` resolved (None -> True with
        prompt_logprobs, and with a trace unless `batch_invariant`, where a prefix-cache hit changes no bit).
        `self` is never modified: one params object may be shared by many prompts of different lengths.
        `speculative`: the engine runs speculative decoding (no traces then). `route_shape`: a MoE model's routes
        (None: a dense model), what `trace_routed_experts` is checked against.
        """
        if self.has_trace:
            check_engine(enable_trace_replay=enable_trace_replay, speculative=speculative)
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        if prompt_len >= max_model_len:
            raise prompt_too_long(prompt_len, max_model_len)
        for name in ("logprobs", "prompt_logprobs"):
            value = vocab_size if getattr(self, name) == -1 else getattr(self, name)  # -1: the whole vocabulary
            if value is not None and value > max_logprobs:
                asked = f"-1 (the whole vocabulary, {value} tokens)" if getattr(self, name) == -1 else value
                raise ValueError(f"{name}={asked} is more than this engine's max_logprobs ({max_logprobs}); an "
                                 "engine built with max_logprobs=-1 has no cap")
            if value is not None and value > vocab_size:
                raise ValueError(f"{name}={value} is more than the model's vocabulary ({vocab_size} tokens)")
        for name in ("trace_decode_token_ids", "stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]  # logit_bias: its keys
            if bad:
                raise ValueError(f"{name} contains ids outside the vocabulary (size {vocab_size}): {bad[:8]}")

        out = self.clone()
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(out, name) == -1:  # vLLM's whole vocabulary (where max_logprobs is -1 or reaches it)
                setattr(out, name, vocab_size)
        if out.top_k >= vocab_size:
            out.top_k = 0  # keeping the whole vocabulary is "off"; also keeps huge values out of the int32 slot
        if out.thinking_token_budget is not None and out.thinking_token_budget > max_model_len:
            # No sequence holds more tokens than max_model_len, so any larger budget is this one; a value past
            # 2**31 would not fit the sampler's int32 slot (an OverflowError that failed the whole engine step).
            out.thinking_token_budget = max_model_len
        if out.skip_reading_prefix_cache is None:
            forced = out.has_trace or out.trace_routed_experts is not None
            out.skip_reading_prefix_cache = out.prompt_logprobs is not None or (forced and not batch_invariant)
        room = max_model_len - prompt_len
        if out.has_trace:
            fit(out, room, trace_replay_chunk_size)
        else:
            # vLLM caps every request at max_model_len; resolving it here makes max_tokens the true bound.
            out.max_tokens = room if out.max_tokens is None else min(out.max_tokens, room)
            if out.min_tokens > out.max_tokens:  # cannot be met: refused, never quietly lowered
                raise ValueError(f"min_tokens={out.min_tokens} cannot be met: the prompt ({prompt_len} tokens) leaves "
                                 f"room for {room} in max_model_len ({max_model_len})")
        if out.trace_routed_experts is not None:  # every position a forward can run: the prompt's, all but the last
            check_routes(out.trace_routed_experts, route_shape, prompt_len + out.max_tokens - 1)
        return out
