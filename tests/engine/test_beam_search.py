"""LLM.beam_search (vLLM's offline beam search, entrypoints/beam_search.py): against an exhaustive search with
transformers' scores, EOS and the length penalty, several prompts, text, and the errors."""

from __future__ import annotations

import itertools

import pytest
import torch
import transformers
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, BeamSearchParams
from replayllm.entrypoints.beam_search import beam_score

PROMPT = [3, 4, 5]


@pytest.fixture(scope="module")
def llm(tiny16):
    return LLM(tiny16, device="cpu", dtype="float32", skip_tokenizer_init=True, max_logprobs=16)


def test_beam_search_params_import_from_vllms_module(llm):
    """vLLM users write `from vllm.sampling_params import BeamSearchParams`: the same class from that path here,
    and LLM.beam_search takes it."""
    from replayllm.sampling_params import BeamSearchParams as FromSamplingParams

    assert FromSamplingParams is BeamSearchParams
    out = llm.beam_search({"prompt_token_ids": PROMPT}, FromSamplingParams(beam_width=2, max_tokens=1))
    assert len(out[0].sequences) == 2


def test_width_of_the_vocabulary_is_an_exhaustive_search(llm, tiny16):
    """beam_width = the vocabulary (16) over 2 tokens keeps every first token and scores every second one: the 16
    best of all 256 continuations, as transformers scores them (same length: ranked by the sum of logprobs)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny16, dtype=torch.float32).eval()
    with torch.no_grad():
        first = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)  # [V]
        seconds = hf(torch.tensor([[*PROMPT, t] for t in range(16)])).logits[:, -1].log_softmax(-1)  # [V, V]
    scores = {(a, b): (first[a] + seconds[a, b]).item() for a, b in itertools.product(range(16), repeat=2)}
    ranked = sorted(scores, key=scores.get, reverse=True)
    out = llm.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=16, max_tokens=2,
                                                                         ignore_eos=True))
    seqs = out[0].sequences
    assert len(seqs) == 16 and all(s.tokens[:3] == PROMPT and len(s.tokens) == 5 for s in seqs)
    got = [tuple(s.tokens[3:]) for s in seqs]
    for s, pair in zip(seqs, got):
        assert abs(s.cum_logprob - scores[pair]) <= 2 * LOGPROB_TOL
        assert s.finish_reason == "length" and len(s.logprobs) == 2 and s.text is None
        assert s.cum_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(s.logprobs, pair)), abs=1e-6)
    # The same 16, in the same order where no two are within rounding of each other.
    margin = scores[ranked[15]] - scores[ranked[16]]
    assert margin > 4 * LOGPROB_TOL, "a near-tie at the border: pick another prompt"
    assert set(got) == set(ranked[:16])
    apart = [scores[ranked[i]] - scores[ranked[i + 1]] > 4 * LOGPROB_TOL for i in range(16)]
    clear = [i for i in range(16) if apart[i] and (i == 0 or apart[i - 1])]  # no near-tie on either side
    assert all(got[i] == ranked[i] for i in clear) and len(clear) > 10


def test_eos_ends_a_beam_and_the_length_penalty_ranks(llm):
    """EOS (id 2) ends a beam (finish_reason "stop", EOS last and nowhere else); beams come best first by
    beam_score, whose length leaves the final EOS out; ignore_eos extends past it."""
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 5], [7, 7], [9, 1, 2, 11])]
    for penalty in (1.0, 0.0, 2.0):
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=penalty))
        assert len(outs) == 3
        for prompt, out in zip(prompts, outs):
            seqs = out.sequences
            assert len(seqs) == 3
            keys = [beam_score(s.tokens, s.cum_logprob, (2,), penalty) for s in seqs]
            assert keys == sorted(keys, reverse=True)
            for s in seqs:
                new = s.tokens[len(prompt["prompt_token_ids"]):]
                assert 2 not in new[:-1] and len(new) == len(s.logprobs) <= 6
                assert s.finish_reason == ("stop" if new[-1] == 2 else "length")
                assert s.finish_reason == "stop" or len(new) == 6
    stopped = [s for out in llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6))
               for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, "no beam met EOS: pick other prompts"
    free = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    assert all(len(s.logprobs) == 6 and s.finish_reason == "length" for out in free for s in out.sequences)


def test_a_batch_of_prompts_gives_each_prompts_own_beams(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [8, 9]}]
    together = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, together):
        alone = llm.beam_search(prompt, params)[0]
        assert [s.tokens for s in out.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(out.sequences, alone.sequences):
            assert a.cum_logprob == pytest.approx(b.cum_logprob, abs=4 * LOGPROB_TOL)


def test_text_prompts_and_decoded_text():
    llm = LLM("replayllm/tiny-qwen3", device="cpu", dtype="float32")
    out = llm.beam_search(["Hello there"], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))[0]
    tok = llm.get_tokenizer()
    prompt_ids = tok.encode("Hello there")
    for s in out.sequences:
        assert s.tokens[: len(prompt_ids)] == prompt_ids
        assert s.text == tok.decode(s.tokens[len(prompt_ids):])


def test_bad_params_are_refused(llm, tiny_models):
    for bad in (dict(beam_width=0, max_tokens=2), dict(beam_width=2, max_tokens=0), dict(beam_width=True, max_tokens=2),
                dict(beam_width=2, max_tokens=2, temperature=-1.0), dict(beam_width=2, max_tokens=2,
                                                                          length_penalty=float("nan"))):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search({"prompt_token_ids": PROMPT}, {"beam_width": 2})
    wide = LLM(tiny_models["qwen3"], device="cpu", dtype="float32", skip_tokenizer_init=True)  # max_logprobs 20
    with pytest.raises(ValueError, match=r"beam_width=11 reads 22 logprobs.*max_logprobs=20"):
        wide.beam_search({"prompt_token_ids": PROMPT}, BeamSearchParams(beam_width=11, max_tokens=2))
