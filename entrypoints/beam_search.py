"""vLLM's offline beam search: `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))` drives a
`BeamSearch` with `LLM.generate`.

Built on generate, as vLLM builds it: every step runs each live beam for one token with logprobs=2 * beam_width
(the prefix cache serves the beam's earlier blocks), extends it by each of those tokens, and keeps the beam_width
best candidates by `beam_score` (the cumulative logprob over the whole sequence length, prompt included, to the
power length_penalty; a final EOS not counted). A candidate ending in EOS is finished (unless ignore_eos). After
max_tokens steps the finished and the live beams together give the beam_width best. The logprobs are the model's
(raw logits, as every logprob the engine reports), so temperature only changes which token each step samples,
which joins the candidates when it is not among the top 2 * beam_width (as in vLLM)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..beam_search_params import BeamSearchParams
from ..outputs import Logprob, RequestOutput
from ..sampling_params import SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's ids then the generated ones (as vLLM's); `logprobs` one dict per
    generated token (the step's top 2 * beam_width and the sampled token); `text` the generated tokens decoded
    (a final EOS left out), None without a tokenizer."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended with EOS) or "length" (max_tokens reached)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first, at most beam_width


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: tuple[int, ...], length_penalty: float
               ) -> float:
    """vLLM's ranking: cum_logprob / len ** length_penalty, len the whole sequence (prompt too) less a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """One search's state over a list of prompts. Its drivers (LLM.beam_search here; the server's
    `use_beam_search`) loop: `next_inputs()` gives the requests of a step (each prompt as given at step 0, each
    live beam's ids after), they run them with `step_params` and hand the outputs, in order, to `advance`;
    `results` ranks what is left once `next_inputs()` is empty."""

    def __init__(self, prompts: list, params: BeamSearchParams, eos_token_ids: tuple[int, ...], vocab_size: int,
                 max_logprobs: int, min_logprobs: int = 0):
        """min_logprobs: at least this many logprobs a step (a server request's `logprobs`, rendered from the
        beams' dicts)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        min_logprobs = vocab_size if min_logprobs == -1 else min_logprobs  # vLLM's -1: the whole vocabulary
        width = min(max(2 * params.beam_width, min_logprobs), vocab_size)  # a smaller vocabulary: all of it
        if width > max_logprobs:
            raise ValueError(f"beam_width={params.beam_width} reads {width} logprobs a step, more than the engine's "
                             f"max_logprobs={max_logprobs}: build the engine with max_logprobs >= {width}")
        self.params, self.prompts = params, prompts
        self.eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.step_params = SamplingParams(max_tokens=1, logprobs=width, temperature=params.temperature,
                                          ignore_eos=True,
                                          include_stop_str_in_output=params.include_stop_str_in_output)
        self.step = 0
        self.live: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.prompt_lens = [0] * len(prompts)
        self._owners: list[int] = []
        self._parents: list[BeamSearchSequence | None] = []

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def next_inputs(self) -> list:
        """The prompts of the next step ([] once max_tokens steps ran or no beam is live)."""
        if self.step >= self.params.max_tokens:
            return []
        if self.step == 0:
            self._owners, self._parents = list(range(len(self.prompts))), [None] * len(self.prompts)
            return list(self.prompts)
        self._owners = [i for i, beams in enumerate(self.live) for _ in beams]
        self._parents = [b for beams in self.live for b in beams]
        return [{"prompt_token_ids": b.tokens} for b in self._parents]

    def advance(self, outs: list[RequestOutput]) -> None:
        """The step's outputs, one per input of next_inputs() in its order."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompts]
        for i, parent, out in zip(self._owners, self._parents, outs, strict=True):
            if parent is None:
                self.prompt_lens[i] = len(out.prompt_token_ids)
                parent = BeamSearchSequence(tokens=list(out.prompt_token_ids))
            step_logprobs = out.outputs[0].logprobs[0]
            for token, lp in step_logprobs.items():
                beam = BeamSearchSequence(tokens=parent.tokens + [token], logprobs=parent.logprobs + [step_logprobs],
                                          cum_logprob=parent.cum_logprob + lp.logprob)
                (self.done[i] if token in self.eos else candidates[i]).append(beam)
        self.live = [sorted(c, key=self.score, reverse=True)[: self.params.beam_width] for c in candidates]
        self.step += 1

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """Per prompt the beam_width best of the finished and live beams; `decode` (a tokenizer's, or None)
        gives each one's text."""
        outputs = []
        for i in range(len(self.prompts)):
            best = sorted(self.done[i] + self.live[i], key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                ended = bool(beam.tokens) and beam.tokens[-1] in self.eos
                beam.finish_reason = "stop" if ended else "length"
                if decode is not None:
                    beam.text = decode(beam.tokens[self.prompt_lens[i]: len(beam.tokens) - ended])
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

