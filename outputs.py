"""Public result types of the engine, shaped like vLLM's (RequestOutput, CompletionOutput, Logprob)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    import numpy as np


@dataclass
class Logprob:
    """One token's log-probability under the model's raw logits.

    `rank` is 1-based: 1 + the number of vocabulary entries with a strictly larger logit, so a forced
    (trace) token the model disliked shows a large rank rather than being hidden.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the chosen token plus the top-k alternatives).
SampleLogprobs = list[dict[int, Logprob]]
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


class _TokensPromptRequired(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokensPromptRequired, total=False):
    """A prompt given as token ids, as in vLLM: `{"prompt_token_ids": [...]}`, optionally with its text.

    Written as a required base plus a `total=False` subclass because `typing.NotRequired` needs
    Python 3.11 and the package supports 3.10.
    """

    prompt: str
