"""Scheduler.running_needs_host_tokens: the count of running requests that may read their tokens on the host stays
equal to a scan of `running` through admission, preemption, finishing and aborts (one id or vLLM's list of ids),
and the async engine still finishes a step first whenever such a request needs its tokens (same outputs as
synchronous steps)."""

from __future__ import annotations

import random

from helpers.hf_reference import VOCAB

from replayllm import LLM, SamplingParams


def _params(i: int) -> SamplingParams:
    if i % 4 == 0:  # reads host tokens until it has 5 outputs
        return SamplingParams(temperature=0, max_tokens=8 + i, min_tokens=5, logprobs=0)
    if i % 4 == 1:  # always reads host tokens
        return SamplingParams(temperature=0, max_tokens=8 + i, repetition_penalty=1.3, logprobs=0)
    return SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True, logprobs=0)


def test_count_follows_running_through_preemption_and_aborts(tiny_models):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    options = dict(device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True, max_num_seqs=6)
    sync = LLM(tiny_models["qwen3"], **options)
    want = [list(o.outputs[0].token_ids) for o in sync.generate([{"prompt_token_ids": p} for p in prompts],
                                                                 [_params(i) for i in range(12)], use_tqdm=False)]

    llm = LLM(tiny_models["qwen3"], async_scheduling=True, num_gpu_blocks_override=8, **options)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, _params(i))
    engine.add_request("gone", {"prompt_token_ids": prompts[0]}, _params(0))
    engine.add_request("gone too", {"prompt_token_ids": prompts[1]}, _params(1))
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:  # vLLM's list form: every id aborted (one unknown id among them changes nothing)
            assert engine.abort_request(["gone", "never added", "gone too"]) is True
            assert engine.abort_request(["gone"]) is False and engine.abort_request("gone too") is False
        sched = engine.scheduler
        assert sched._num_host_readers == sum(r.may_read_host_tokens for r in sched.running)
        assert sched.running_needs_host_tokens() == any(r.needs_host_tokens for r in sched.running)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler._num_host_readers == 0
    assert [got[str(i)] for i in range(12)] == want
