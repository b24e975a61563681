"""Randomised engine stress: slot reuse, preemption, chunked prefill, n > 1, aborts and traces all at once.
Every surviving request must equal the same request run alone (tokens exact; no cross-talk between slots)."""

from __future__ import annotations

import random

import pytest
from helpers.hf_reference import VOCAB
from helpers.trace_replay_common import DEVICE, drive_with_arrivals_and_aborts  # gpu_check.sh re-runs this file on CUDA

from replayllm import LLM, SamplingParams


def _random_request(rng: random.Random):
    prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]
    kind = rng.choice(["trace", "greedy", "seeded", "n2", "stop_ids", "penalty"])
    if kind == "trace":
        params = SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 25))],
                                logprobs=1)
    elif kind == "greedy":
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True)
    elif kind == "seeded":
        params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=rng.randrange(1, 20), seed=rng.randrange(999),
                                ignore_eos=True)
    elif kind == "n2":
        params = SamplingParams(n=2, temperature=1.0, max_tokens=rng.randrange(1, 12), seed=rng.randrange(999),
                                ignore_eos=True)
    elif kind == "stop_ids":  # ~1 in 4 tokens stops: requests end mid-batch, also with a step in flight
        params = SamplingParams(temperature=0.8, seed=rng.randrange(999), max_tokens=rng.randrange(1, 30),
                                stop_token_ids=rng.sample(range(VOCAB), VOCAB // 4), ignore_eos=True,
                                min_tokens=rng.choice([0, 0, 3]))
    else:  # the sampler reads this request's tokens on the host: async scheduling must wait for them
        params = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.5,
                                max_tokens=rng.randrange(1, 20), ignore_eos=True)
    return {"prompt_token_ids": prompt}, params


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_random_mix_equals_solo_runs(tiny_models, async_scheduling):
    rng = random.Random(2024)
    requests = [_random_request(rng) for _ in range(60)]
    # Tight engine: 4 slots, 24 blocks of 4 tokens (preemption), a 16-token budget (chunked prefill).
    tight = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", max_model_len=96, block_size=4,
                num_gpu_blocks_override=24, max_num_seqs=4, max_num_batched_tokens=16, enable_trace_replay=True,
                skip_tokenizer_init=True, async_scheduling=async_scheduling)
    engine = tight.llm_engine
    results, aborted = drive_with_arrivals_and_aborts(engine, requests, rng)
    assert engine.scheduler.num_preemptions > 0 and engine.max_running_in_step == 4
    assert (engine.num_overlapped_steps > 0) == async_scheduling
    roomy = LLM(tiny_models["qwen3"], device=DEVICE, dtype="float32", max_model_len=96, enable_trace_replay=True,
                skip_tokenizer_init=True)
    checked = 0
    for i, (prompt, params) in enumerate(requests):
        if str(i) in aborted:
            assert str(i) not in results
            continue
        solo = roomy.generate([prompt], params, use_tqdm=False)[0]
        got = results[str(i)]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in solo.outputs], i
        if params.trace_decode_token_ids:
            assert got.outputs[0].token_ids == params.trace_decode_token_ids
        checked += 1
    assert checked >= 45
    # Slots of finished requests are released at the next step, even an empty one.
    assert engine.step() == []
    assert len(engine.runner.req_states.free_slots) == 4 and not engine.runner.req_states.req_id_to_slot
