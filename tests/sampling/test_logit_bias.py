"""logit_bias and allowed_token_ids end to end on a tiny Llama: they steer the choice of token, while the
reported logprobs stay the model's raw ones; batch neighbours and later owners of the slot are unaffected."""

from __future__ import annotations

import pytest
from helpers.hf_reference import VOCAB, hf_rank, load_hf, teacher_forced
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [1, 45, 300, 12, 77]}
OTHER = {"prompt_token_ids": [1, 9, 410, 3]}


@pytest.fixture(scope="module")
def llm(tiny_models):
    # No prefix caching: two runs of one prompt then do the same computation, so their logprobs are bitwise
    # equal (trace_replay.md, "Reproducibility"). Three slots, so the slot-reuse test reuses them quickly.
    return LLM(tiny_models["llama"], device="cpu", dtype="float32", max_model_len=128, max_num_seqs=3,
               skip_tokenizer_init=True, enable_trace_replay=True, enable_prefix_caching=False)


def _gen(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _reported(comp) -> list[dict[int, tuple[float, int]]]:
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in comp.logprobs]


def _greedy(llm, prompt=PROMPT, n=6) -> list[int]:
    return _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


def test_greedy_bias_forces_the_token_and_logprobs_stay_raw(llm, tiny_models):
    free = _greedy(llm)
    t = next(x for x in range(3, VOCAB) if x not in free)  # a token greedy decoding never picks here
    biased = _gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                                                 logit_bias={t: 100.0}))[0]
    assert biased.token_ids == [t] * 6
    # The same tokens forced by a trace, without bias: identical numbers, top-k entries included.
    # One token per step, as the biased run computed them (fast replay: equal within rounding only).
    replay = _gen(llm, [PROMPT], SamplingParams(trace_decode_token_ids=[t] * 6, logprobs=3,
                                                trace_replay_chunk_size=1))[0]
    assert _reported(biased) == _reported(replay)
    assert biased.cumulative_logprob == replay.cumulative_logprob
    # And they are the model's own numbers: transformers' teacher-forced log_softmax of the same tokens.
    lp, _ = teacher_forced(load_hf(tiny_models["llama"]), PROMPT["prompt_token_ids"], biased.token_ids)
    for i, d in enumerate(biased.logprobs):
        assert d[t].logprob == pytest.approx(float(lp[i, t]), abs=LOGPROB_TOL, rel=0)  # engine vs transformers
        assert d[t].rank == hf_rank(lp[i], t) > 1  # the model itself would not pick t: the bias did
    # A -100 bias bans the greedy choice instead.
    banned = _greedy(llm)[0]
    first = _gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=1, logit_bias={banned: -100.0}))[0]
    assert first.token_ids[0] != banned


def test_allowed_token_ids_restrict_random_sampling(llm):
    a, b = 17, 230
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=0,
                            allowed_token_ids=[a, b])
    out = _gen(llm, [PROMPT], params)[0]
    assert set(out.token_ids) <= {a, b} and len(out.token_ids) == 24
    assert set(out.token_ids) == {a, b}  # both are sampled: a real draw, not a forced argmax
    replay = _gen(llm, [PROMPT], SamplingParams(trace_decode_token_ids=out.token_ids, logprobs=0,
                                                trace_replay_chunk_size=1))[0]  # the run's own one-token steps
    assert _reported(out) == _reported(replay)  # raw logprobs, not renormalised over {a, b}
    assert sum(d[t].logprob for d, t in zip(out.logprobs, out.token_ids)) < -1.0
    # Greedy argmax sees the whitelist too.
    greedy = _gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                allowed_token_ids=[a, b]))[0]
    assert set(greedy.token_ids) <= {a, b}


def test_mixed_batch_equals_solo_runs(llm):
    t = 333
    batch = [
        (PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={t: 100.0})),
        (OTHER, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)),
        (PROMPT, SamplingParams(temperature=0.9, seed=3, max_tokens=5, ignore_eos=True, top_k=20)),
    ]
    together = _gen(llm, [p for p, _ in batch], [s for _, s in batch])
    solo = [_gen(llm, [p], s)[0] for p, s in batch]
    assert [c.token_ids for c in together] == [c.token_ids for c in solo]
    assert together[0].token_ids == [t] * 5
    assert t not in together[1].token_ids + together[2].token_ids
    # Another request's whitelist does not reach its neighbours either.
    batch[0] = (PROMPT, SamplingParams(temperature=0.9, seed=5, max_tokens=5, ignore_eos=True,
                                       allowed_token_ids=[t, t + 1]))
    together = _gen(llm, [p for p, _ in batch], [s for _, s in batch])
    assert set(together[0].token_ids) <= {t, t + 1}
    assert [c.token_ids for c in together[1:]] == [c.token_ids for c in solo[1:]]


def test_slot_reuse_does_not_leak_bias_or_whitelist(llm):
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    baseline = [_gen(llm, [p], plain)[0].token_ids for p in (PROMPT, OTHER)]
    big_bias = {x: -5.0 for x in range(3, 200)}  # longer than the initial device rows: they grow
    big_bias[404] = 100.0
    for constrained in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=big_bias),
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=[99])):
        # Fill every slot (max_num_seqs=3) with constrained requests, then reuse them for plain ones.
        forced = _gen(llm, [PROMPT, OTHER, PROMPT], constrained)
        assert all(set(c.token_ids) == {404 if constrained.logit_bias else 99} for c in forced)
        again = _gen(llm, [PROMPT, OTHER, OTHER], plain)
        assert [c.token_ids for c in again] == [baseline[0], baseline[1], baseline[1]]


def test_engine_rejects_out_of_vocab_ids(llm):
    for field, value in (("logit_bias", {VOCAB: 1.0}), ("allowed_token_ids", [5, VOCAB + 3])):
        with pytest.raises(ValueError, match=rf"{field} contains ids outside the vocabulary \(size {VOCAB}\)"):
            llm.generate([PROMPT], SamplingParams(**{field: value}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias cannot be combined with trace_decode_token_ids"):
        SamplingParams(trace_decode_token_ids=[5], logit_bias={5: 1.0})
