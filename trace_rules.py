"""Trace replay's rules, all in one place: what a trace may be combined with, and how it fits an engine.

Callers: SamplingParams (when it is built, and in `verify_for_engine`: the path of `LLM` and of every HTTP
endpoint), EngineConfig (engine options) and the completions endpoint (its HTTP-only `echo`). The trace's ids
are checked as a list of token ids like any other (SamplingParams `_id_list`, the vocabulary in
`verify_for_engine`); everything about what a trace means is here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

TRACE = "trace_decode_token_ids"
# The completions endpoint's `echo` combined with another field: rule names of check_options (HTTP only).
EchoCombination = Literal["echo_logprobs", "echo_prompt_only"]


class TracedParams(Protocol):
    """The SamplingParams fields these rules set (a Protocol: this module sits below sampling_params.py)."""

    trace_decode_token_ids: list[int] | None
    trace_replay_chunk_size: int | None
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop: list[str] | str | None
    stop_token_ids: list[int] | None


class TraceConflict(ValueError):
    """A request option that cannot be combined with a trace. `option` names the request field at fault (an
    HTTP 400's `param`); the message says why."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option

    def __reduce__(self):  # pickled whole across the engine-core process boundary
        return type(self), (self.option, str(self))


@dataclass(frozen=True)
class _Rule:
    option: str  # the request field the error names
    conflicts: Callable[[Any], bool]  # the option's value -> it cannot be combined with a trace
    message: str  # formatted with the value as {value}


def _is_set(value: Any) -> bool:
    return value is not None


def _picks_token(option: str, conflicts: Callable[[Any], bool]) -> _Rule:
    return _Rule(option, conflicts, f"{option} cannot be combined with {TRACE} (the trace picks every token)")


# Checked in this order. Everything that shapes or constrains the choice of token would be silently overridden
# by the trace: rejected instead of ignored. Token rules (bans, biases, whitelists) conflict when non-empty ([]
# bans nothing, {} biases nothing); features when set at all (0 or {} is still a request for the feature).
_RULES: dict[str, _Rule] = {
    "n": _Rule("n", lambda n: n > 1, f"n must be 1 with {TRACE} (a trace is one output), got {{value}}"),
    "prompt_logprobs": _Rule("prompt_logprobs", _is_set, f"prompt_logprobs cannot be combined with {TRACE}"),
    **{name: _picks_token(name, bool) for name in ("bad_words", "logit_bias", "allowed_token_ids")},
    **{name: _picks_token(name, _is_set)
       for name in ("structured_outputs", "repetition_detection", "thinking_token_budget")},
    # The completions endpoint's `echo` (HTTP only). With logprobs it asks for the prompt's logprobs: the
    # prompt_logprobs rule, named after the field that asked.
    "echo_logprobs": _Rule("echo", bool, f"echo with logprobs needs prompt logprobs, which cannot be combined "
                                         f"with {TRACE}; drop echo or logprobs"),
    # With max_tokens 0 it scores the prompt and generates nothing, where a trace is generated tokens.
    "echo_prompt_only": _Rule(TRACE, bool, f"echo with max_tokens 0 scores the prompt only; {TRACE} forces "
                                           "generated tokens: drop one of them"),
}
# The SamplingParams fields among the rules' names.
PARAM_OPTIONS = tuple(name for name in _RULES if name not in get_args(EchoCombination))


def check_options(options: Mapping[str, Any]) -> None:
    """The rules between a trace and the request's other options, given by name: SamplingParams' fields
    (PARAM_OPTIONS), or the completions endpoint's `echo_logprobs` / `echo_prompt_only` (bools). Raises
    TraceConflict for the first option that breaks one; names not given are not checked."""
    for name, rule in _RULES.items():
        if name in options and rule.conflicts(options[name]):
            raise TraceConflict(rule.option, rule.message.format(value=options[name]))


def apply_request_rules(p: TracedParams, options: Mapping[str, Any]) -> None:
    """A traced request's rules that need no engine (SamplingParams.__post_init__): `options` (PARAM_OPTIONS of
    `p`) pass check_options, then the output is exactly the trace: `max_tokens` its length, never cut short by
    EOS or stop conditions."""
    check_options(options)
    p.max_tokens = len(p.trace_decode_token_ids)
    p.min_tokens = 0
    p.ignore_eos = True
    p.stop = []
    p.stop_token_ids = []


def check_chunk_size_needs_trace(chunk_size: int | None) -> None:
    """A request without a trace: `trace_replay_chunk_size` must be unset."""
    if chunk_size is not None:
        raise ValueError(f"trace_replay_chunk_size needs {TRACE} (it sets how many trace tokens are replayed "
                         "per step)")


def check_engine_options(enable_trace_replay: bool, speculative: bool) -> None:
    """EngineConfig: trace replay and speculative decoding exclude each other (vLLM's rule)."""
    if enable_trace_replay and speculative:
        raise ValueError("speculative decoding (speculative_config) is incompatible with trace replay "
                         "(enable_trace_replay): replay must be the only thing choosing tokens")


def check_engine(*, enable_trace_replay: bool, speculative: bool) -> None:
    """A traced request against the engine it is sent to (SamplingParams.verify_for_engine)."""
    if speculative:  # the engine also refuses both options together (check_engine_options)
        raise ValueError(f"{TRACE} cannot be used while speculative decoding (speculative_config) is on: the "
                         "trace must be the only thing choosing tokens")
    if not enable_trace_replay:
        raise ValueError(f"{TRACE} needs trace replay, which this engine has off; start it with "
                         "enable_trace_replay=True (LLM) or --enable-trace-replay (replayllm serve)")


def fit(p: TracedParams, room: int, engine_chunk_size: int) -> None:
    """A traced request's copy fitted to its engine (SamplingParams.verify_for_engine): the trace is cut to the
    `room` max_model_len leaves after the prompt (like any request, a replay stops there, finish_reason
    "length"), `max_tokens` follows it, and an unset `trace_replay_chunk_size` becomes the engine's."""
    p.trace_decode_token_ids = p.trace_decode_token_ids[:room]
    p.max_tokens = len(p.trace_decode_token_ids)
    if p.trace_replay_chunk_size is None:
        p.trace_replay_chunk_size = engine_chunk_size
