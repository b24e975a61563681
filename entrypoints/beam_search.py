"""vLLM's offline beam search: `LLM.beam_search(prompts, BeamSearchParams(beam_width, max_tokens))`.

Built on generate, as vLLM builds it: every step runs each live beam for one token with logprobs=2 * beam_width
(the prefix cache serves the beam's earlier blocks), extends it by each of those tokens, and keeps the beam_width
best candidates by `beam_score` (the cumulative logprob over the whole sequence length, prompt included, to the
power length_penalty; a final EOS not counted). A candidate ending in EOS is finished (unless ignore_eos). After
max_tokens steps the finished and the live beams together give the beam_width best. The logprobs are the model's
(raw logits, as every logprob the engine reports), so temperature only changes which token each step samples,
which joins the candidates when it is not among the top 2 * beam_width (as in vLLM)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..outputs import Logprob
from ..sampling_params import SamplingParams

if TYPE_CHECKING:
    from .llm import LLM


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, lo in (("temperature", 0.0), ("length_penalty", -math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value < math.inf:
                raise ValueError(f"{name} must be a finite number{' >= 0' if lo == 0.0 else ''}, got {value!r}")


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


def beam_search(llm: LLM, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """prompts: a str, a {"prompt_token_ids": [...]} / {"prompt": ...} dict, or a list of those."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    engine = llm.llm_engine
    width = min(2 * params.beam_width, engine.model_config.vocab_size)  # a vocabulary of fewer tokens: all of them
    if width > engine.config.max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} reads {width} logprobs a step, more than the engine's "
                         f"max_logprobs={engine.config.max_logprobs}: build the LLM with max_logprobs >= {width}")
    eos = () if params.ignore_eos else tuple(engine.model_config.eos_token_ids)
    step_params = SamplingParams(max_tokens=1, logprobs=width, temperature=params.temperature, ignore_eos=True,
                                 include_stop_str_in_output=params.include_stop_str_in_output, detokenize=False)

    def score(beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

    live: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    prompt_lens = [0] * len(prompts)
    for step in range(params.max_tokens):
        # Step 0 sends each prompt as given (its own tokenization); later steps each live beam's ids.
        owners = list(range(len(prompts))) if step == 0 else [i for i, beams in enumerate(live) for _ in beams]
        parents = [None] * len(prompts) if step == 0 else [b for beams in live for b in beams]
        if not owners:
            break
        inputs = prompts if step == 0 else [{"prompt_token_ids": b.tokens} for b in parents]
        outs = llm.generate(inputs, step_params, use_tqdm=use_tqdm and step == 0)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for i, parent, out in zip(owners, parents, outs):
            if parent is None:
                prompt_lens[i] = len(out.prompt_token_ids)
                parent = BeamSearchSequence(tokens=list(out.prompt_token_ids))
            step_logprobs = out.outputs[0].logprobs[0]
            for token, lp in step_logprobs.items():
                beam = BeamSearchSequence(tokens=parent.tokens + [token], logprobs=parent.logprobs + [step_logprobs],
                                          cum_logprob=parent.cum_logprob + lp.logprob)
                (done[i] if token in eos else candidates[i]).append(beam)
        live = [sorted(c, key=score, reverse=True)[: params.beam_width] for c in candidates]
    tokenizer = llm.get_tokenizer()
    results = []
    for i in range(len(prompts)):
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        for beam in best:
            ended = bool(beam.tokens) and beam.tokens[-1] in eos
            beam.finish_reason = "stop" if ended else "length"
            if tokenizer is not None:
                beam.text = tokenizer.decode(beam.tokens[prompt_lens[i]: len(beam.tokens) - ended])
        results.append(BeamSearchOutput(sequences=best))
    return results
