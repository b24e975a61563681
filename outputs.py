"""Public result types of the engine, shaped like vLLM's (RequestOutput, CompletionOutput, Logprob)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypedDict

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Logprob:
    """One token's log-probability under the model's raw logits.

    `rank` is 1-based: the number of vocabulary entries whose logit is >= the token's (vLLM's), so a forced
    (trace) token the model disliked shows a large rank rather than being hidden.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class LogprobColumns(NamedTuple):
    """FlatLogprobs.columns(): n tokens, k alternatives each, best first (alternative j has rank j + 1)."""

    token_ids: list[int]  # [n] the chosen (or forced) token
    logprobs: list[float]  # [n] its logprob (float32 values)
    ranks: list[int]  # [n] its 1-based rank
    topk_ids: list[int]  # [n * k]
    topk_logprobs: list[float]  # [n * k]
    k: int


class FlatLogprobs(Sequence):
    """One completion's per-token logprobs, stored flat and read like `list[dict[int, Logprob]]`.

    The engine appends a few numbers per generated token (the chosen id, its logprob and rank, the top-k ids
    and logprobs) instead of building a dict and k + 1 Logprob objects on the engine loop: position i's
    `{token: Logprob}` (chosen token first, then the top-k not already there, ranks 1..k) is built when read.
    Slices give plain lists. `snapshot()` is a fixed-length view sharing the storage (later appends do not
    show in it), which is how outputs handed out stay unchanged while the completion grows."""

    __slots__ = ("_tokens", "_logprob", "_rank", "_topk_ids", "_topk_logprobs", "_k", "_decode", "_n")

    def __init__(self, k: int, decode: Callable[[int], str | None] | None = None):
        """k: top-k alternatives kept per token (the request's `logprobs`); decode: token id -> text."""
        self._tokens: list[int] = []
        self._logprob: list[float] = []
        self._rank: list[int] = []
        self._topk_ids: list[int] = []  # [n * k]
        self._topk_logprobs: list[float] = []  # [n * k]
        self._k, self._decode, self._n = k, decode, 0

    def append_token(self, token: int, logprob: float, rank: int, topk_ids: list[int],
                     topk_logprobs: list[float], start: int = 0) -> None:
        """One generated token; topk_ids / topk_logprobs hold at least k entries from `start` on, best first
        (the engine passes its step's flat [rows * K] lists with start = row * K). Runs per row per step on
        the engine loop: no checks beyond what the append needs."""
        self._tokens.append(token)
        self._logprob.append(logprob)
        self._rank.append(rank)
        k = self._k
        if k:
            self._topk_ids.extend(topk_ids[start : start + k])
            self._topk_logprobs.extend(topk_logprobs[start : start + k])
        self._n += 1

    def extend_tokens(self, tokens: list[int], logprobs: list[float], ranks: list[int], topk_ids: list[int],
                      topk_logprobs: list[float], start: int, stride: int) -> None:
        """n tokens at once (a fast-replay row's chunk): token j's top-k starts at start + j * stride in the
        step's flat lists (stride = the step's K >= k). Same result as n `append_token` calls."""
        self._tokens.extend(tokens)
        self._logprob.extend(logprobs)
        self._rank.extend(ranks)
        n, k = len(tokens), self._k
        if k == stride:
            self._topk_ids.extend(topk_ids[start : start + n * k])
            self._topk_logprobs.extend(topk_logprobs[start : start + n * k])
        elif k:
            for j in range(start, start + n * stride, stride):
                self._topk_ids.extend(topk_ids[j : j + k])
                self._topk_logprobs.extend(topk_logprobs[j : j + k])
        self._n += n

    def snapshot(self) -> FlatLogprobs:
        view = _FlatLogprobsSnapshot.__new__(_FlatLogprobsSnapshot)
        for name in FlatLogprobs.__slots__:  # not self.__slots__: a snapshot's own (empty) when it is one
            setattr(view, name, getattr(self, name))
        return view

    def __len__(self) -> int:
        return self._n

    def columns(self) -> LogprobColumns:
        """The stored numbers as flat lists (no per-token objects), for writers that want arrays."""
        n, k = self._n, self._k
        return LogprobColumns(self._tokens[:n], self._logprob[:n], self._rank[:n], self._topk_ids[: n * k],
                              self._topk_logprobs[: n * k], k)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._position(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"logprobs position {i} out of range for {self._n} tokens")
        return self._position(i)

    def _position(self, i: int) -> dict[int, Logprob]:
        decode, token, k = self._decode, self._tokens[i], self._k
        d = {token: Logprob(self._logprob[i], self._rank[i], decode(token) if decode else None)}
        for j in range(k):
            tid = self._topk_ids[i * k + j]
            if tid not in d:
                d[tid] = Logprob(self._topk_logprobs[i * k + j], j + 1, decode(tid) if decode else None)
        return d

    def __eq__(self, other) -> bool:
        if not isinstance(other, (FlatLogprobs, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # mutable, like a list

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"


class _FlatLogprobsSnapshot(FlatLogprobs):
    """A fixed-length view handed out with a step's output: it shares the storage and never grows."""

    __slots__ = ()

    def append_token(self, *args, **kwargs) -> None:
        raise ValueError("a FlatLogprobs snapshot is read-only")


# One dict per generated token: token id -> Logprob (the chosen token plus the top-k alternatives). The engine
# hands out FlatLogprobs (built lazily); a DELTA output's slice is a plain list.
SampleLogprobs = FlatLogprobs | list[dict[int, Logprob]]
# One entry per prompt token; the first is None because nothing predicts the first prompt token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of a request's `n` completions, cumulative so far (or final once `finish_reason` is set).

    With `SamplingParams.output_kind=DELTA`, text/token_ids/logprobs/full_logprobs hold only what is new since
    the request's previous output (concatenated they give the cumulative ones); cumulative_logprob stays
    cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort", as in vLLM
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    # replayllm extension (SamplingParams.return_full_logprobs): per generated token, the raw log-softmax over
    # the whole vocabulary, a [V] float32 numpy array; None when not requested.
    full_logprobs: list[np.ndarray] | None = None
    # Mixture-of-experts models with enable_return_routed_experts (vLLM's field; docs/moe.md): the experts each
    # layer routed every position to, numpy int16 [seq_len - 1, num_layers, top_k] over prompt + generated tokens
    # (position p: the forward that read token p; the last token was never fed). Dense layers of a mixed model
    # are -1. Set once finished (None before, when off, and on an aborted request).
    routed_experts: np.ndarray | None = None
    lora_request: None = None  # vLLM's field, for code that reads it: always None (no LoRA)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything the engine reports for one request: the prompt and its completions."""

    request_id: str
    prompt: str | None  # None when the request came as token ids without text
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # vLLM's other RequestOutput fields, for code that reads them: always None here (no per-request stats
    # object, no LoRA, no encoder-decoder models, no KV transfer).
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    """A prompt given as token ids, as in vLLM: `{"prompt_token_ids": [...]}`, optionally with its text.

    Written as a required base plus a `total=False` subclass because `typing.NotRequired` needs
    Python 3.11 and the package supports 3.10.
    """

    prompt: str
