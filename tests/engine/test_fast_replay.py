"""Fast replay (trace_replay_chunk_size > 1): a replaying request runs up to k trace tokens per step and reports
the same tokens, logprobs, ranks and top-k as one-token replay (bitwise only in batch-invariant mode; else
within fp32 rounding) and as transformers' teacher-forced log_softmax; across trace lengths, max_model_len
cuts, mixed batches, aborts, prefix-cache hits, small token budgets, preemption and async scheduling."""

from __future__ import annotations

import dataclasses
import random

import pytest
from helpers.hf_reference import hf_rank, teacher_forced
from helpers.trace_replay_common import (
    BATCH_NOISE,
    DEVICE,
    HF_TOL,
    RANKS_COMPARABLE,
    TIE,
    _chosen,
    _ids,
    _rand_ids,
    _tiny,
)

from replayllm import SamplingParams
from replayllm.config import EngineConfig
from replayllm.engine.scheduler import Scheduler

HAS_BATCH_INVARIANT = "batch_invariant" in {f.name for f in dataclasses.fields(EngineConfig)}
# Same request, other matmul and attention shapes (a k-token chunk vs one token): summation order only, the
# project's "same request, another computation" bound (BATCH_NOISE: tolerances.LOGPROB_TOL in fp32, derived there).
CHUNK_TOL = BATCH_NOISE


def _requests(seed: int, trace_lens=(23, 3, 8, 1), logprobs: int = 5):
    """Token-id prompts with traces: longer than a chunk, shorter, exactly one chunk, a single token; plus two
    requests without a trace (greedy with logprobs, seeded sampling) in the same batch."""
    rng = random.Random(seed)
    prompts = [_ids(_rand_ids(rng, rng.randrange(2, 20), lo=3)) for _ in range(len(trace_lens) + 2)]
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, n), logprobs=logprobs) for n in trace_lens]
    params += [SamplingParams(temperature=0, max_tokens=9, logprobs=2),
               SamplingParams(temperature=0.8, seed=5, max_tokens=7)]
    return prompts, params


def _assert_same_replay(a, b, tol: float) -> None:
    """Two runs of the same requests: tokens and text equal; logprobs, top-k logprobs within tol; ranks equal
    except where two logprobs are within TIE (a near-tie may order either way), in fp32 (RANKS_COMPARABLE)."""
    for oa, ob in zip(a, b):
        ca, cb = oa.outputs[0], ob.outputs[0]
        assert ca.token_ids == cb.token_ids and ca.finish_reason == cb.finish_reason
        if ca.logprobs is None:
            continue
        for da, db in zip(ca.logprobs, cb.logprobs):
            for tok in set(da) & set(db):
                assert abs(da[tok].logprob - db[tok].logprob) <= tol
            values = sorted(lp.logprob for lp in da.values())
            near_tie = any(y - x < TIE for x, y in zip(values, values[1:]))
            if RANKS_COMPARABLE and not near_tie:
                assert {t: lp.rank for t, lp in da.items()} == {t: lp.rank for t, lp in db.items()}


def _run(path, prompts, params, **opts):
    llm = _tiny(path, **opts)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.llm_engine


@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_chunked_replay_equals_one_token_replay(tiny_models, model):
    prompts, params = _requests(1)
    one, e1 = _run(tiny_models[model], prompts, params, trace_replay_chunk_size=1)
    fast, e8 = _run(tiny_models[model], prompts, params, trace_replay_chunk_size=8)
    for p, o in zip(params, fast):
        if p.trace_decode_token_ids is not None:
            assert o.outputs[0].token_ids == p.trace_decode_token_ids
    _assert_same_replay(one, fast, CHUNK_TOL)
    # 23 trace tokens: prefill + 22 one-token steps vs prefill + 3 chunks.
    assert e8.num_steps < e1.num_steps


def test_chunked_replay_bitwise_in_batch_invariant_mode(tiny_models):
    if not HAS_BATCH_INVARIANT:
        pytest.skip("EngineConfig has no batch_invariant option on this branch (issue 13's batch-invariant "
                    "kernels): chunked replay is only compared within fp32 rounding here")
    prompts, params = _requests(2)
    one, _ = _run(tiny_models["qwen3"], prompts, params, trace_replay_chunk_size=1, batch_invariant=True)
    fast, _ = _run(tiny_models["qwen3"], prompts, params, trace_replay_chunk_size=8, batch_invariant=True)
    for oa, ob in zip(one, fast):
        assert oa.outputs[0].token_ids == ob.outputs[0].token_ids
        assert oa.outputs[0].logprobs == ob.outputs[0].logprobs  # ==: logprob, rank and top-k, bit for bit


def test_chunked_replay_matches_transformers_teacher_forced(tiny_models, hf_models):
    rng = random.Random(3)
    prompts = [_rand_ids(rng, n, lo=3) for n in (5, 13)]
    traces = [_rand_ids(rng, n) for n in (30, 11)]
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces]
    outs, _ = _run(tiny_models["qwen3"], [_ids(p) for p in prompts], params, trace_replay_chunk_size=8)
    for prompt, trace, out in zip(prompts, traces, outs):
        lp, _ = teacher_forced(hf_models["qwen3"], prompt, trace)
        for i, (tok, logprob, rank) in enumerate(_chosen(out.outputs[0])):
            assert tok == trace[i]
            assert abs(logprob - float(lp[i, tok])) < HF_TOL
            ties = int(((lp[i] - lp[i, tok]).abs() < TIE).sum()) - 1  # other tokens within TIE of the forced one
            assert abs(rank - hf_rank(lp[i], tok)) <= ties


def test_trace_cut_at_max_model_len(tiny_models):
    rng = random.Random(4)
    prompt = _ids(_rand_ids(rng, 10, lo=3))
    params = SamplingParams(trace_decode_token_ids=_rand_ids(rng, 40), logprobs=1)
    fast, _ = _run(tiny_models["qwen3"], [prompt], [params], max_model_len=32, trace_replay_chunk_size=8)
    one, _ = _run(tiny_models["qwen3"], [prompt], [params], max_model_len=32, trace_replay_chunk_size=1)
    comp = fast[0].outputs[0]
    assert comp.token_ids == params.trace_decode_token_ids[:22] and comp.finish_reason == "length"
    _assert_same_replay(one, fast, CHUNK_TOL)


def test_small_token_budget_blocks_and_preemption(tiny_models):
    """A 16-token budget cuts chunks and prefills; 20 blocks of 4 tokens force preemption by recompute while
    chunks are in flight. Same results as a roomy one-token run (a recomputed prefill: batch noise)."""
    rng = random.Random(5)
    prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (12, 9, 14, 11, 7)]
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, n), logprobs=3) for n in (40, 35, 30, 44, 20)]
    small, engine = _run(tiny_models["qwen3"], prompts, params, max_model_len=64, block_size=4,
                         num_gpu_blocks_override=20, max_num_batched_tokens=16, trace_replay_chunk_size=4)
    roomy, _ = _run(tiny_models["qwen3"], prompts, params, max_model_len=64, block_size=4,
                    trace_replay_chunk_size=1)
    assert engine.scheduler.num_preemptions > 0
    _assert_same_replay(roomy, small, BATCH_NOISE)


def test_prefix_cache_hits(tiny_models):
    llm = _tiny(tiny_models["qwen2"], trace_replay_chunk_size=6)
    rng = random.Random(8)
    prefix = _rand_ids(rng, 40, lo=3)
    prompts = [_ids(prefix + _rand_ids(rng, k, lo=3)) for k in (1, 4, 9)]
    # Cache reads opted in (a trace computes its whole prompt by default: tests/engine/test_self_replay.py).
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, n), logprobs=4, skip_reading_prefix_cache=False)
              for n in (20, 6, 15)]
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in second)
    _assert_same_replay(first, second, BATCH_NOISE)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_mid_replay_frees_blocks(tiny_models, async_scheduling):
    """Steps by hand: a replaying request gains k tokens per decode step; aborting it mid-replay frees its
    blocks (the conftest checks every block is free at the end), the other request finishes intact."""
    llm = _tiny(tiny_models["llama"], trace_replay_chunk_size=4, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    rng = random.Random(9)
    traces = [_rand_ids(rng, 30), _rand_ids(rng, 25)]
    for rid, trace in zip("ab", traces):
        engine.add_request(rid, _ids(_rand_ids(rng, 6, lo=3)), SamplingParams(trace_decode_token_ids=trace))
    counts = []
    while len(counts) < 4:
        engine.step()
        req = engine.scheduler.requests["a"]
        counts.append(req.num_output_tokens)
    assert counts[-1] - counts[-2] == 4  # decode steps emit a whole chunk
    assert engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["b"] and finished["b"].outputs[0].token_ids == traces[1]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_scheduling_equals_sync(tiny_models):
    prompts, params = _requests(10, trace_lens=(31, 17, 5))
    sync, _ = _run(tiny_models["qwen3"], prompts, params, trace_replay_chunk_size=4, async_scheduling=False)
    overlapped, engine = _run(tiny_models["qwen3"], prompts, params, trace_replay_chunk_size=4,
                              async_scheduling=True)
    assert engine.num_overlapped_steps > 0
    _assert_same_replay(sync, overlapped, BATCH_NOISE)


def test_delta_outputs_carry_whole_chunks(tiny_models):
    """Streaming (output_kind DELTA): one step's output holds the chunk's tokens, text and logprobs; the
    deltas add up to the final completion."""
    llm = _tiny(tiny_models["qwen3"], trace_replay_chunk_size=5)
    rng = random.Random(11)
    trace = _rand_ids(rng, 17)
    prompt = _ids(_rand_ids(rng, 4, lo=3))
    engine = llm.llm_engine
    engine.add_request("d", prompt, SamplingParams(trace_decode_token_ids=trace, logprobs=2,
                                                   return_full_logprobs=True, output_kind=1))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0] for o in engine.step()]
    assert [len(d.token_ids) for d in deltas] == [1, 5, 5, 5, 1]
    assert sum((d.token_ids for d in deltas), []) == trace
    assert sum(len(d.logprobs) for d in deltas) == len(trace) == sum(len(d.full_logprobs) for d in deltas)
    ref = llm.generate([prompt], SamplingParams(trace_decode_token_ids=trace, logprobs=2,
                                                trace_replay_chunk_size=1), use_tqdm=False)[0].outputs[0]
    got = [d for delta in deltas for d in delta.logprobs]
    full = [row for d in deltas for row in d.full_logprobs]
    assert all(float(row[t]) == x[t].logprob for row, x, t in zip(full, got, trace))
    # Chunks vs one-token steps: the same ranks, except where another token is within TIE (rounding may swap them).
    for row, x, y, t in zip(full, got, ref.logprobs, trace):
        if int((abs(row - row[t]) < TIE).sum()) == 1:
            assert x[t].rank == y[t].rank


def test_per_request_chunk_size_and_validation(tiny_models):
    llm = _tiny(tiny_models["qwen3"], trace_replay_chunk_size=16)
    rng = random.Random(12)
    prompt = _ids(_rand_ids(rng, 3, lo=3))
    trace = _rand_ids(rng, 9)
    engine = llm.llm_engine
    steps = []
    for k in (None, 1, 4):
        start = engine.num_steps
        llm.generate([prompt], SamplingParams(trace_decode_token_ids=trace, trace_replay_chunk_size=k),
                     use_tqdm=False)
        steps.append(engine.num_steps - start)
    assert steps == [2, 9, 3]  # prefill + 8 tokens in one chunk / eight steps / two chunks of 4
    with pytest.raises(ValueError, match="trace_replay_chunk_size needs trace_decode_token_ids"):
        SamplingParams(max_tokens=3, trace_replay_chunk_size=4)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="trace_replay_chunk_size"):
            SamplingParams(trace_decode_token_ids=[1], trace_replay_chunk_size=bad)
    with pytest.raises(ValueError, match="trace_replay_chunk_size must be >= 1"):
        EngineConfig(model=tiny_models["qwen3"], trace_replay_chunk_size=0)


def test_scheduler_lookahead_respects_budget_and_free_blocks():
    """No model: the lookahead is cut by the trace left, the token budget and the free blocks (minus one kept
    per later running request), and never preempts."""
    from replayllm.engine.block_manager import BlockManager
    from replayllm.engine.request import Request

    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64, enable_chunked_prefill=True)
    a = Request("a", [1, 2, 3], SamplingParams(trace_decode_token_ids=[7] * 10, trace_replay_chunk_size=8), 0, (), 0)
    b = Request("b", [4, 5], SamplingParams(trace_decode_token_ids=[8] * 3, trace_replay_chunk_size=8), 0, (), 1)
    for r in (a, b):
        sched.add_request(r)
    out = sched.schedule()  # prefills only: one sampled token each
    assert [(r.num_scheduled_tokens, r.num_sampled_tokens) for r in out.rows] == [(3, 1), (2, 1)]
    sched.update(out, {"a": 7, "b": 8})
    out = sched.schedule()
    # a: 1 + 7 lookahead (chunk 8) = 8 tokens, blocks for 3 + 8 = 11 tokens (3 of 4 free kept one for b);
    # b: trace of 3, one emitted: 1 + 1 lookahead, within the 4 tokens of budget left.
    assert [(r.num_scheduled_tokens, r.num_sampled_tokens) for r in out.rows] == [(8, 8), (2, 2)]
    sched.update(out, {"a": list(range(8)), "b": [9, 9]})
    assert b.is_finished and a.num_output_tokens == 9 and sched.num_new_tokens == 10
    out = sched.schedule()
    assert [(r.num_scheduled_tokens, r.num_sampled_tokens) for r in out.rows] == [(1, 1)]
    sched.update(out, {"a": 3})
    assert a.is_finished and bm.num_free_blocks == bm.num_blocks and sched.num_preemptions == 0


def test_scheduler_lookahead_in_a_large_batch_leaves_room_for_later_rows():
    """Lookahead at any batch size (a bigger eager step amortises its fixed cost; docs/trace_replay.md), but never
    at the expense of the rows behind it: each later running request keeps one token of the budget."""
    from replayllm.engine.block_manager import BlockManager
    from replayllm.engine.request import Request

    n = 300  # more than the 128 running requests that once switched lookahead off
    bm = BlockManager(num_blocks=8 * n, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=n, max_num_batched_tokens=2 * n + 6, max_model_len=64,
                      enable_chunked_prefill=True)
    reqs = [Request(f"r{i}", [1, 2], SamplingParams(trace_decode_token_ids=[7] * 8, trace_replay_chunk_size=4),
                    0, (), i) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()  # prefills (2 tokens each: the budget holds all of them, plus 6)
    assert len(out.rows) == n
    sched.update(out, {r.request_id: 7 for r in reqs})
    out = sched.schedule()
    # Budget 2n + 6 over n decode rows: every row gets its token, and the spare n + 6 go to lookahead in arrival
    # order, 3 per row (chunk 4) -- without ever taking a later row's token.
    assert [r.request_id for r in out.rows] == [r.request_id for r in reqs]
    got = [(r.num_scheduled_tokens, r.num_sampled_tokens) for r in out.rows]
    assert sum(t for t, _ in got) == 2 * n + 6
    assert got[:2] == [(4, 4), (4, 4)] and got[-1] == (1, 1)
    assert all(t == s and t >= 1 for t, s in got)
    sched.update(out, {r.request_id: 7 if r.num_sampled_tokens == 1 else [7] * r.num_sampled_tokens
                       for r in out.rows})
    for r in list(sched.running):
        sched.abort(r.request_id)
    assert bm.num_free_blocks == bm.num_blocks


def test_trace_kernel_step_offsets():
    """The trace kernel with per-row step offsets (one slot on several rows) equals its torch reference."""
    import torch

    from replayllm.kernels.trace_replay import trace_replay_torch, trace_replay_triton, use_triton_trace_kernel

    dev = torch.device(DEVICE)
    i32 = dict(dtype=torch.int32, device=dev)
    trace = torch.arange(40, **i32).reshape(2, 20) + 100
    total_len, prompt_len = torch.tensor([7, 5], **i32), torch.tensor([3, 5], **i32)
    trace_len = torch.tensor([6, 20], **i32)
    idx = torch.tensor([0, 0, 0, 1, 1, -1], device=dev)
    offsets = torch.tensor([0, 1, 2, 0, 1, 0], device=dev)
    want = [104, 105, -1, 120, 121, -1]  # slot 0: steps 4, 5, then 6 = past its trace
    fns = [trace_replay_triton, trace_replay_torch] if use_triton_trace_kernel(dev) else [trace_replay_torch]
    for fn in fns:
        sampled = torch.full((6,), -1, dtype=torch.int64, device=dev)
        fn(sampled, idx, total_len, prompt_len, trace, trace_len, offsets)
        assert sampled.tolist() == want
    with pytest.raises(ValueError, match="step_offsets"):
        trace_replay_torch(torch.zeros(6, dtype=torch.int64, device=dev), idx, total_len, prompt_len, trace,
                           trace_len, offsets[:3])


def test_command_lines_take_the_chunk_size():
    """`--trace-replay-chunk-size` on the engine commands (every EngineConfig option) and on `diff`, where it
    sets both engine sides (None: each engine's own)."""
    from replayllm.entrypoints.cli.main import build_parser

    parser = build_parser()
    bench = parser.parse_args(["bench", "throughput", "--trace", "--trace-replay-chunk-size", "1"])
    assert bench.trace_replay_chunk_size == 1
    # Unset: EngineConfig picks one token a step, or FAST_REPLAY_CHUNK_SIZE with batch_invariant
    # (tests/engine/test_self_replay.py).
    assert parser.parse_args(["serve"]).trace_replay_chunk_size is None
    diff = ["diff", "--traces", "t.jsonl", "--a", "default", "--b", "default"]
    assert parser.parse_args(diff).trace_replay_chunk_size is None
    assert parser.parse_args([*diff, "--trace-replay-chunk-size", "1"]).trace_replay_chunk_size == 1


def test_activation_reserve_covers_a_full_budget_of_logits():
    """Fast replay (and speculation) may score every token of a step's budget: the KV cache leaves room for
    [max_num_batched_tokens, V] logits then, and the plain 2 GiB otherwise."""
    import types

    import torch

    from replayllm.model_runner_v2.kv_cache import activation_reserve_bytes

    def cfg(**kw):
        qwen3_0_6b = types.SimpleNamespace(vocab_size=151_936, dtype=torch.bfloat16, num_heads=16, num_kv_heads=8,
                                           head_dim=128, hf_config=types.SimpleNamespace(hidden_size=1024,
                                                                                         intermediate_size=3072))
        base = dict(model_config=qwen3_0_6b, max_num_seqs=256,
                    max_num_batched_tokens=8192, enable_trace_replay=False, speculative_config=None,
                    enable_fp32_lm_head=False, use_piecewise_cuda_graphs=False)
        return types.SimpleNamespace(**{**base, **kw})

    assert activation_reserve_bytes(cfg()) == 2 << 30  # 256 rows of logits: 78 MB, under the floor
    assert activation_reserve_bytes(cfg(enable_trace_replay=True)) == 8192 * 151_936 * 2 + (1 << 30)
    assert activation_reserve_bytes(cfg(speculative_config=object(), enable_fp32_lm_head=True)) == \
        8192 * 151_936 * 4 + (1 << 30)


def test_trace_is_stored_once_and_fast_replay_reads_it():
    """The runner holds a trace once, in the sampler's trace rows: a slot's token buffer has only the known tokens,
    and a fast-replay chunk [last token, trace[i], ...] gathers its upcoming input ids from the trace rows."""
    import numpy as np
    import torch

    from replayllm.model_runner_v2.input_batch import prepare_inputs
    from replayllm.model_runner_v2.request_states import RequestStates
    from replayllm.sampling.trace_replay_state import TraceReplayState

    states = RequestStates(max_num_reqs=2, max_model_len=16, max_blocks_per_seq=4, device=torch.device("cpu"))
    trace = TraceReplayState(max_num_reqs=2, max_model_len=16, device="cpu")
    slots = [states.add_request("a", [1, 2, 3], 3, [0, 1]), states.add_request("b", [4, 5, 6, 20], 3, [2, 3])]
    trace.add_request(slots[0], [7, 8, 9, 10])
    trace.add_request(slots[1], [20, 21, 22])  # resumed after preemption: trace[0] already emitted
    states.apply_staged_writes()
    trace.apply_staged_writes()
    assert not states.token_ids[slots[0], 3:].any() and not states.token_ids[slots[1], 4:].any()
    # a: the prompt's last token + 2 trace tokens; b: its last known token + the rest of its trace.
    batch = prepare_inputs(states, np.array(slots), np.array([2, 3]), np.array([3, 3]), np.array([3, 3]), 4, trace)
    assert batch.input_ids.tolist() == [3, 7, 8, 20, 21, 22]
    assert batch.positions.tolist() == [2, 3, 4, 3, 4, 5]
