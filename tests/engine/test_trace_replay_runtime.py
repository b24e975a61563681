"""Trace replay across the engine's runtime corners: chunked prefill (no token for a partial chunk),
preemption by recompute (resumes at the right trace position), prefix-cache hits, slot reuse and abort; and
the user guide's examples run as written."""

from __future__ import annotations

import pathlib
import random
import re

import pytest
from helpers.hf_reference import teacher_forced
from helpers.trace_replay_common import (
    BATCH_NOISE,
    HF_TOL,
    RANKS_COMPARABLE,
    _chosen,
    _full,
    _ids,
    _max_delta,
    _rand_ids,
    _tiny,
)

from replayllm import SamplingParams


# -- runtime corners -------------------------------------------------------------------------------------
def test_chunked_prefill_emits_nothing_for_partial_chunks(tiny_models, tiny_llms, hf_models):
    # Per-step emission is the synchronous loop's contract (with async scheduling, the default on CUDA, a
    # step's tokens arrive one step() later; tests/engine/test_async_scheduling.py covers that loop).
    llm = _tiny(tiny_models["qwen3"], max_num_batched_tokens=8, async_scheduling=False)
    engine = llm.llm_engine
    rng = random.Random(4)
    prompts = {"a": _rand_ids(rng, 30, lo=3), "b": _rand_ids(rng, 13, lo=3)}
    traces = {"a": _rand_ids(rng, 6), "b": _rand_ids(rng, 9)}
    for rid in prompts:
        engine.add_request(rid, _ids(prompts[rid]),
                           SamplingParams(trace_decode_token_ids=traces[rid], logprobs=2))
    requests = dict(engine.scheduler.requests)
    finals, first_token_step, step = {}, {}, 0
    while engine.has_unfinished_requests():
        active = [rid for rid, r in requests.items() if not r.is_finished]
        emitted = {out.request_id: out for out in engine.step()}
        step += 1
        for rid in active:
            req = requests[rid]
            # A token exactly when the whole prompt has run: never for a partial chunk.
            assert (rid in emitted) == (req.num_computed_tokens >= req.num_prompt_tokens), (step, req)
        for rid, out in emitted.items():
            got = out.outputs[0].token_ids
            assert got == traces[rid][: len(got)]  # the first one is trace[0]: step 0 of the trace
            first_token_step.setdefault(rid, step)
            if out.finished:
                finals[rid] = out.outputs[0]
    assert first_token_step["a"] == 4  # 30 prompt tokens, 8 per step: chunks of 8, 8, 8 and 6
    assert first_token_step["b"] > 4  # b's prefill shares the budget with a
    plain = tiny_llms["qwen3"].generate(
        [_ids(prompts[r]) for r in "ab"],
        [SamplingParams(trace_decode_token_ids=traces[r], logprobs=2) for r in "ab"], use_tqdm=False)
    for rid, ref in zip("ab", plain):
        assert finals[rid].token_ids == traces[rid]
        assert _max_delta(finals[rid], ref.outputs[0]) < BATCH_NOISE
        hf_lp, _ = teacher_forced(hf_models["qwen3"], prompts[rid], traces[rid])
        for i, (tok, logprob, _) in enumerate(_chosen(finals[rid])):
            assert abs(logprob - float(hf_lp[i, tok])) <= HF_TOL


def test_preemption_resumes_at_the_right_trace_position(tiny_models):
    rng = random.Random(6)
    prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (12, 9, 14, 11)]
    traces = [_rand_ids(rng, n) for n in (40, 35, 30, 44)]
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=3) for t in traces]
    # 4 requests of ~50 tokens need ~50 blocks of 4; 20 blocks force preemption by recompute.
    # A 16-token budget also chunks the recomputed prefill of a resumed request.
    # One-token replay here; tests/engine/test_fast_replay.py covers preemption under chunked replay.
    small = _tiny(tiny_models["qwen3"], max_model_len=64, block_size=4, num_gpu_blocks_override=20,
                  max_num_batched_tokens=16, trace_replay_chunk_size=1)
    roomy = _tiny(tiny_models["qwen3"], max_model_len=64, block_size=4)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    ref = roomy.generate(prompts, params, use_tqdm=False)
    assert roomy.llm_engine.scheduler.num_preemptions == 0
    for trace, g, r in zip(traces, got, ref):
        assert g.outputs[0].token_ids == trace
        if RANKS_COMPARABLE:
            assert [x[2] for x in _chosen(g.outputs[0])] == [x[2] for x in _chosen(r.outputs[0])]
        # A recomputed prefill sums in another order than the decode steps did: equal up to float noise.
        assert _max_delta(g.outputs[0], r.outputs[0]) < BATCH_NOISE


def test_prefix_cache_hits_keep_replay_close(tiny_llms):
    llm = tiny_llms["qwen2"]
    rng = random.Random(8)
    prefix = _rand_ids(rng, 40, lo=3)
    prompts = [_ids(prefix + _rand_ids(rng, k, lo=3)) for k in (1, 4, 9)]
    # Cache reads opted in (a trace computes its whole prompt by default: tests/engine/test_self_replay.py).
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, n), logprobs=4, skip_reading_prefix_cache=False)
              for n in (10, 6, 15)]
    llm.llm_engine.block_manager.reset_prefix_cache()
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in first)
    assert all(o.num_cached_tokens >= 32 for o in second)
    for p, a, b in zip(params, first, second):
        assert b.outputs[0].token_ids == p.trace_decode_token_ids
        # A cache hit runs only the uncached tail: other prefill shapes, equal up to summation order.
        assert _max_delta(a.outputs[0], b.outputs[0]) <= BATCH_NOISE


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_slot_reuse_does_not_leak_a_trace(tiny_models, max_num_seqs):
    llm = _tiny(tiny_models["qwen3"], max_num_seqs=max_num_seqs, max_model_len=64)
    rng = random.Random(9)
    prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (5, 7, 6, 8, 4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, 3), logprobs=2), greedy,
              SamplingParams(trace_decode_token_ids=_rand_ids(rng, 15), logprobs=2), greedy,
              SamplingParams(trace_decode_token_ids=_rand_ids(rng, 2), logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.max_running_in_step <= max_num_seqs  # five requests through one or two slots
    for i in (1, 3):
        solo = llm.generate(prompts[i], greedy, use_tqdm=False)[0].outputs[0]
        assert outs[i].outputs[0].token_ids == solo.token_ids
        assert all(rank == 1 for _, _, rank in _chosen(outs[i].outputs[0]))
        assert _max_delta(outs[i].outputs[0], solo) < BATCH_NOISE
        # A leaked trace would have forced these tokens.
        assert outs[i].outputs[0].token_ids[:2] != params[i - 1].trace_decode_token_ids[:2]
    for i in (0, 2, 4):
        assert outs[i].outputs[0].token_ids == params[i].trace_decode_token_ids


def test_abort_mid_trace_releases_the_slot_and_its_trace(tiny_models):
    llm = _tiny(tiny_models["qwen3"], max_num_seqs=1, max_model_len=64, async_scheduling=False,  # per-step
                trace_replay_chunk_size=1)  # one token a step (test_fast_replay.py aborts mid-chunk)
    engine = llm.llm_engine
    prompt = _ids([5, 6, 7])  # shorter than a block: no prefix-cache hit can change the computation
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
    trace = _rand_ids(random.Random(10), 20)
    engine.add_request("doomed", prompt, SamplingParams(trace_decode_token_ids=trace))
    for n in (1, 2):
        assert [list(o.outputs[0].token_ids) for o in engine.step()] == [trace[:n]]
    assert engine.abort_request("doomed") and not engine.has_unfinished_requests()
    after = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]  # the same (only) slot, reused
    assert _full(after) == _full(before) and after.token_ids[:2] != trace[:2]
    assert not engine.runner.sampler.trace.has_trace.any()


def test_guide_examples_run(capsys):
    """Every Python block of docs/trace_replay.md runs as written (the use-case blocks assert themselves)."""
    guide = pathlib.Path(__file__).resolve().parents[2] / "docs" / "trace_replay.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, str(guide), "exec"), {"__name__": "__guide__"})
    printed = capsys.readouterr().out
    assert printed.startswith("15 ") and "bf16" in printed and "max |delta| =" in printed
