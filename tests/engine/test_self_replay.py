"""Replaying an engine's own output reproduces what its sampler saw, bit for bit, by default: the default
`trace_replay_chunk_size` is one token a step (the shapes the tokens were sampled with), a trace computes its
whole prompt instead of reading the prompt's cached blocks (the sampling run left them there; a cache hit would
run a shorter prefill), and fast replay is the default only in batch-invariant mode, where it is bitwise too.
bench/gpu_check.sh re-runs this file on CUDA in fp32 and bf16 (REPLAYLLM_TEST_DEVICE / REPLAYLLM_TEST_DTYPE)."""

from __future__ import annotations

import random

import pytest
from helpers.trace_replay_common import _full, _ids, _rand_ids, _tiny

from replayllm import SamplingParams
from replayllm.config import FAST_REPLAY_CHUNK_SIZE, EngineConfig


def test_default_chunk_size_is_one_token_unless_batch_invariant(tiny_models):
    path = tiny_models["qwen3"]
    assert EngineConfig(model=path, device="cpu").trace_replay_chunk_size == 1
    assert EngineConfig(model=path, device="cpu", batch_invariant=True).trace_replay_chunk_size \
        == FAST_REPLAY_CHUNK_SIZE
    assert EngineConfig(model=path, device="cpu", trace_replay_chunk_size=8).trace_replay_chunk_size == 8
    assert EngineConfig(model=path, device="cpu", batch_invariant=True,
                        trace_replay_chunk_size=1).trace_replay_chunk_size == 1
    with pytest.raises(ValueError, match="trace_replay_chunk_size"):
        EngineConfig(model=path, device="cpu", trace_replay_chunk_size=0)


def test_a_trace_reads_no_cached_prompt_unless_asked(tiny_models):
    """Prompts longer than a block: the sampling run caches them, the replay computes them again in full (so its
    first position runs the prefill the sampler ran), and the same replay twice gives the same bits."""
    llm = _tiny(tiny_models["qwen3"])
    prompts = [_ids(list(range(3, 3 + n))) for n in (17, 40)]
    sampled = llm.generate(prompts, SamplingParams(max_tokens=5, logprobs=2, temperature=0), use_tqdm=False)
    traces = [SamplingParams(trace_decode_token_ids=list(o.outputs[0].token_ids), logprobs=2) for o in sampled]
    first = llm.generate(prompts, traces, use_tqdm=False)
    again = llm.generate(prompts, traces, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in first + again)
    _assert_bitwise(sampled, first)
    _assert_bitwise(first, again)
    opted_in = [SamplingParams(trace_decode_token_ids=p.trace_decode_token_ids, logprobs=2,
                               skip_reading_prefix_cache=False) for p in traces]
    hits = llm.generate(prompts, opted_in, use_tqdm=False)
    assert [o.num_cached_tokens for o in hits] == [16, 32]


def _generate_then_replay(llm, seed: int):
    """Generate a batch (greedy and seeded sampling, top-3 logprobs, outputs longer than a fast-replay chunk),
    then replay every output as a trace in the same batch on the same engine. Returns both runs."""
    rng = random.Random(seed)
    prompts = [_ids(_rand_ids(rng, rng.randrange(3, 40), lo=3)) for _ in range(6)]
    params = [SamplingParams(max_tokens=rng.randrange(70, 90), ignore_eos=True, logprobs=3,
                             temperature=0.0 if i % 2 else 1.0, seed=i) for i in range(len(prompts))]
    sampled = llm.generate(prompts, params, use_tqdm=False)
    traces = [SamplingParams(trace_decode_token_ids=list(o.outputs[0].token_ids), logprobs=3) for o in sampled]
    steps_before = llm.llm_engine.num_steps
    replayed = llm.generate(prompts, traces, use_tqdm=False)
    return sampled, replayed, llm.llm_engine.num_steps - steps_before


def _assert_bitwise(sampled, replayed) -> None:
    for a, b in zip(sampled, replayed):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        # Every reported entry (the emitted token and the top-3), logprob and rank, compared exactly.
        assert _full(cb) == _full(ca)


@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_self_replay_is_bitwise_by_default(tiny_models, model):
    llm = _tiny(tiny_models[model])
    sampled, replayed, steps = _generate_then_replay(llm, seed=1)
    _assert_bitwise(sampled, replayed)
    longest = max(len(o.outputs[0].token_ids) for o in sampled)
    assert steps >= longest  # one trace token a step (a prefill step emits the first)


def test_self_replay_is_bitwise_with_fast_replay_in_batch_invariant_mode(tiny_models):
    llm = _tiny(tiny_models["qwen3"], batch_invariant=True)
    assert llm.llm_engine.config.trace_replay_chunk_size == FAST_REPLAY_CHUNK_SIZE
    sampled, replayed, steps = _generate_then_replay(llm, seed=2)
    _assert_bitwise(sampled, replayed)
    longest = max(len(o.outputs[0].token_ids) for o in sampled)
    assert steps < longest  # fast replay ran (several trace tokens a step)

