"""Engine vs transformers (fp32, CPU) on tiny random Qwen3/Llama/Qwen2: greedy tokens and logprobs, also under
forced chunked prefill, forced preemption and prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_reference import VOCAB, hf_greedy, hf_rank, load_hf, teacher_forced
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

NUM_NEW = 12
# The engine's and transformers' logits each within LOGPROB_TOL of the true ones: a top-2 margin under twice that
# may legitimately pick either token.
NEAR_TIE = 2 * LOGPROB_TOL


def _prompts(seed: int = 0, n: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 7, 16, 17, 30, 45, 64, 100][:n]  # ragged, across block boundaries
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for length in lengths]


def _engine_run(path: str, prompts: list[list[int]], **opts):
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, block_size=16,
              skip_tokenizer_init=True, **opts)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _check_against_hf(hf, prompts, completions) -> None:
    for prompt, comp in zip(prompts, completions):
        ref_tokens, margins = hf_greedy(hf, prompt, NUM_NEW)
        # Greedy tokens equal HF's up to the first near-tie (where either choice is legitimate in fp32).
        for i, (a, b) in enumerate(zip(comp.token_ids, ref_tokens)):
            if a != b:
                assert margins[i] < NEAR_TIE, f"diverged at {i} with margin {margins[i]}"
                break
        # Logprobs of the engine's own tokens vs HF teacher-forced log_softmax on the same weights.
        lp, _ = teacher_forced(hf, prompt, comp.token_ids)
        for i, token in enumerate(comp.token_ids):
            got = comp.logprobs[i][token]
            assert abs(got.logprob - float(lp[i, token])) <= LOGPROB_TOL
            assert got.rank == hf_rank(lp[i], token)
            top = sorted(comp.logprobs[i].items(), key=lambda kv: kv[1].rank)
            ref_top = lp[i].topk(3)
            assert [t for t, v in top if v.rank <= 3][:1] == [int(ref_top.indices[0])]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_greedy_and_logprobs_match_hf(tiny_models, arch):
    prompts = _prompts()
    llm, comps = _engine_run(tiny_models[arch], prompts)
    assert len(prompts) >= 8 and llm.llm_engine.max_running_in_step == len(prompts)  # one batch
    _check_against_hf(load_hf(tiny_models[arch]), prompts, comps)


def test_same_tokens_under_chunked_prefill_preemption_and_prefix_hits(tiny_models):
    path = tiny_models["qwen3"]
    prompts = _prompts(seed=1)
    _, base = _engine_run(path, prompts)

    # Chunked prefill: a 24-token budget splits every long prompt into several chunks.
    llm, chunked = _engine_run(path, prompts, max_num_batched_tokens=24)
    assert [c.token_ids for c in chunked] == [c.token_ids for c in base]
    assert llm.llm_engine.num_steps > len(base[0].token_ids) + 5

    # Preemption by recompute: a KV cache far too small for the whole batch.
    llm, preempted = _engine_run(path, prompts, num_gpu_blocks_override=16)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in preempted] == [c.token_ids for c in base]
    for a, b in zip(preempted, base):
        for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(x[t].logprob - y[t].logprob) <= LOGPROB_TOL  # a recomputed prefill: summation order

    # Prefix caching: prompts sharing a 64-token prefix; the second wave hits the cache.
    rng = random.Random(7)
    prefix = [rng.randrange(3, VOCAB) for _ in range(64)]
    shared = [prefix + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (1, 5, 20)]
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=0)
    first = llm.generate([{"prompt_token_ids": shared[0]}], params, use_tqdm=False)[0]
    rest = llm.generate([{"prompt_token_ids": p} for p in shared[1:]], params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens == 64 for o in rest)
    hf = load_hf(path)
    _check_against_hf(hf, shared[1:], [o.outputs[0] for o in rest])


def test_bf16_runs_close_to_fp32(tiny_models):
    prompts = _prompts(n=4)
    _, fp32 = _engine_run(tiny_models["qwen3"], prompts)
    llm = LLM(tiny_models["qwen3"], device="cpu", dtype="bfloat16", max_model_len=256, enable_trace_replay=True,
              skip_tokenizer_init=True)
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(trace_decode_token_ids=c.token_ids, logprobs=0) for c in fp32],
                        use_tqdm=False)
    deltas = [abs(o.outputs[0].logprobs[i][t].logprob - c.logprobs[i][t].logprob)
              for o, c in zip(outs, fp32) for i, t in enumerate(c.token_ids)]
    assert 0 < max(deltas) < 0.5  # bf16 really differs, but stays close on a tiny model
