"""batch_invariant=True end to end: a request's tokens, logprobs, ranks and top-k are bit-identical however it was
batched, chunked, cached or scheduled, and a token's decode logprob equals its prompt logprob when the sequence
is sent again. CPU fp32 here; bench/gpu_check.sh re-runs this file on CUDA in fp32 and bf16
(REPLAYLLM_TEST_DEVICE / REPLAYLLM_TEST_DTYPE, read by trace_replay_common). The compiled kernels and real CUDA
graphs: the `gpu`-marked tests at the end."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_reference import VOCAB
from helpers.trace_replay_common import DEVICE, DTYPE, drive_with_arrivals_and_aborts

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.kernels.batch_invariant_attention import paged_attention_invariant_triton
from replayllm.kernels.batch_invariant_matmul import batch_invariant_linear_triton


def _llm(path: str, **kw) -> LLM:
    opts = dict(batch_invariant=True, device=DEVICE, dtype=DTYPE, max_model_len=256, skip_tokenizer_init=True,
                enable_trace_replay=True)
    opts.update(kw)
    return LLM(path, **opts)


def _bits(comp) -> tuple:
    """Everything a completion reports per token, as exact values: tokens, then (token -> (logprob, rank))."""
    return comp.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in comp.logprobs]


def _prompt_bits(out) -> list:
    return [None if d is None else {t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.prompt_logprobs]


def _prompts(seed: int, n: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])  # qwen2: linear biases; qwen3: q/k norm, tied head
def test_batch_of_one_equals_batch_of_many(tiny_models, name):
    llm = _llm(tiny_models[name])
    prompts = _prompts(1, 6)
    batch = llm.generate(_ids(prompts), GREEDY, use_tqdm=False)
    for prompt, got in zip(prompts, batch):
        solo = llm.generate(_ids([prompt]), GREEDY, use_tqdm=False)[0]
        assert _bits(got.outputs[0]) == _bits(solo.outputs[0])


def test_chunked_prefill_at_any_token_budget(tiny_models):
    prompts = _prompts(2, 3, lo=40, hi=90)
    results = []
    for budget in (7, 16, 61, 512):
        llm = _llm(tiny_models["qwen3"], max_num_batched_tokens=budget)
        results.append([_bits(o.outputs[0]) for o in llm.generate(_ids(prompts), GREEDY, use_tqdm=False)])
    assert all(r == results[-1] for r in results)


def test_prefix_cache_hit_equals_full_prefill(tiny_models):
    base = _prompts(3, 1, lo=50, hi=51)[0]
    other = base[:33] + [5, 6, 7, 8, 9]  # shares two 16-token blocks with base
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    cached = _llm(tiny_models["qwen3"])
    first = cached.generate(_ids([base]), params, use_tqdm=False)[0]
    again, hit_other = cached.generate(_ids([base, other]), params, use_tqdm=False)
    cold = _llm(tiny_models["qwen3"], enable_prefix_caching=False)
    cold_base, cold_other = cold.generate(_ids([base, other]), params, use_tqdm=False)
    assert _bits(again.outputs[0]) == _bits(first.outputs[0]) == _bits(cold_base.outputs[0])
    assert _bits(hit_other.outputs[0]) == _bits(cold_other.outputs[0])
    # Prompt logprobs of a cache hit start after the cached part; where both report, the bits agree.
    for got, ref in ((again, cold_base), (hit_other, cold_other)):
        for a, b in zip(_prompt_bits(got), _prompt_bits(ref)):
            if a is not None and b is not None:
                assert a == b


def test_async_scheduling_on_and_off(tiny_models):
    prompts = _prompts(4, 5)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    runs = [[_bits(o.outputs[0]) for o in _llm(tiny_models["qwen3"], async_scheduling=mode, max_num_seqs=3)
             .generate(_ids(prompts), params, use_tqdm=False)] for mode in (False, True)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_decode_logprob_equals_prompt_logprob(tiny_models, name):
    """The RL case: score a sampled continuation again as a prompt (teacher forcing) and get the same bits,
    logprob, rank and top-k, for every token, with other requests in both batches."""
    llm = _llm(tiny_models[name])
    prompts = _prompts(5, 3)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=4, ignore_eos=True)
    decoded = llm.generate(_ids(prompts), sampled, use_tqdm=False)
    full = [p + list(d.outputs[0].token_ids) for p, d in zip(prompts, decoded)]
    scored = llm.generate(_ids(full), SamplingParams(max_tokens=1, prompt_logprobs=4), use_tqdm=False)
    for prompt, dec, sc in zip(prompts, decoded, scored):
        comp = dec.outputs[0]
        for i, (token, entries) in enumerate(zip(comp.token_ids, comp.logprobs)):
            prompt_entry = sc.prompt_logprobs[len(prompt) + i]
            assert prompt_entry[token].logprob == entries[token].logprob
            assert prompt_entry[token].rank == entries[token].rank
            assert ({t: lp.logprob for t, lp in prompt_entry.items()}
                    == {t: lp.logprob for t, lp in entries.items()})


def test_trace_replay_bits_do_not_depend_on_the_batch(tiny_models):
    llm = _llm(tiny_models["llama"], max_num_batched_tokens=24)
    rng = random.Random(6)
    traces = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=2) for t in traces]
    prompts = _prompts(6, 4)
    batch = llm.generate(_ids(prompts), params, use_tqdm=False)
    for prompt, p, got in zip(prompts, params, batch):
        assert _bits(got.outputs[0]) == _bits(llm.generate(_ids([prompt]), p, use_tqdm=False)[0].outputs[0])


def test_random_mix_of_40_requests_equals_solo_runs(tiny_models):
    """40 requests with random lengths, token budgets (max_tokens), shared prefixes (cache hits), prompt
    logprobs and aborts, arriving while others run on a tight engine (chunked prefill, preemption); each
    survivor is bit-identical to the same request run alone on a roomy engine."""
    rng = random.Random(2025)
    stems = _prompts(7, 4, lo=20, hi=40)
    requests = []
    for _ in range(40):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.4:
            prompt = rng.choice(stems) + prompt[: rng.randrange(0, 8)]  # a prefix-cache hit once the stem ran
        if rng.random() < 0.3:
            params = SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))],
                                    logprobs=2)
        else:
            params = SamplingParams(temperature=rng.choice([0, 0.8]), seed=rng.randrange(99), logprobs=2,
                                    max_tokens=rng.randrange(1, 10), ignore_eos=True,
                                    prompt_logprobs=rng.choice([None, None, 1]))
        requests.append(({"prompt_token_ids": prompt}, params))
    tight = _llm(tiny_models["qwen3"], max_model_len=96, block_size=4, num_gpu_blocks_override=24,
                 max_num_seqs=5, max_num_batched_tokens=rng.choice([12, 16]))
    engine = tight.llm_engine
    results, aborted = drive_with_arrivals_and_aborts(engine, requests, rng)
    roomy = _llm(tiny_models["qwen3"], max_model_len=96)
    checked = 0
    for i, (prompt, params) in enumerate(requests):
        if str(i) in aborted:
            continue
        solo = roomy.generate([prompt], params, use_tqdm=False)[0]
        assert _bits(results[str(i)].outputs[0]) == _bits(solo.outputs[0]), i
        if params.prompt_logprobs is not None:
            assert _prompt_bits(results[str(i)]) == _prompt_bits(solo), i
        checked += 1
    assert checked >= 30 and aborted
    assert engine.scheduler.num_preemptions > 0


# -- configuration --------------------------------------------------------------------------------------------
def test_config_flag_env_and_rejections(tiny_models, monkeypatch):
    path = tiny_models["qwen3"]
    assert EngineConfig(path, device="cpu").batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        EngineConfig(path, device="cpu", batch_invariant="yes")
    for method in ("int8", "fp8"):
        with pytest.raises(ValueError, match="batch_invariant=True does not support quantization"):
            EngineConfig(path, device="cpu", batch_invariant=True, quantization=method)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(path, device="cpu", batch_invariant=True, tensor_parallel_size=2)
    for var in ("REPLAYLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):
        monkeypatch.setenv(var, "1")
        assert EngineConfig(path, device="cpu").batch_invariant is True
        monkeypatch.delenv(var)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert EngineConfig(path, device="cpu").batch_invariant is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "true")  # vLLM reads an int: a "true" is an error, not silently off
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT must be 0 or 1"):
        EngineConfig(path, device="cpu")


def test_command_line_flag_and_resolved_facts(tiny_models):
    import argparse

    from replayllm.entrypoints.cli.engine_args import add_engine_args, engine_kwargs
    from replayllm.entrypoints.diff.resolved import describe, engine_resolved

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parser.parse_args([]))["batch_invariant"] is False
    from replayllm.entrypoints.diff.spec import parse_spec

    assert parse_spec("batch_invariant=true").options["batch_invariant"] is True
    config = EngineConfig(tiny_models["qwen3"], device="cpu", batch_invariant=True)
    facts = engine_resolved(config)
    assert facts["batch_invariant"] is True and "batch_invariant=True" in describe(facts)


def test_layers_switch_to_the_invariant_paths(tiny_models):
    from replayllm.model_runner_v2.attention import Attention
    from replayllm.model_runner_v2.models.layers import Linear

    for flag in (False, True):
        llm = _llm(tiny_models["qwen3"], batch_invariant=flag)  # the LLM owns (and would shut down) its engine
        model = llm.llm_engine.runner.model
        switched = [m.batch_invariant for m in model.modules() if isinstance(m, (Linear, Attention))]
        assert len(switched) == 2 * 5 + 1 and set(switched) == {flag}  # 2 layers: qkv, o, gate_up, down, attn; lm_head


def test_triton_path_under_the_interpreter(tiny_models, monkeypatch):
    """The CUDA path (Triton matmul, fixed-tile attention, fused layer kernels, logprobs kernel) run by the
    interpreter on CPU: a request next to another gives the bits it gets alone, and its decode logprobs equal
    its prompt logprobs."""
    if DEVICE != "cpu":
        pytest.skip("the compiled kernels are covered by the CUDA run of this file")
    from replayllm.kernels import dispatch

    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    llm = _llm(tiny_models["qwen3"], attention_backend="triton", max_num_batched_tokens=16)
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [30, 31, 32]]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    pair = llm.generate(_ids(prompts), params, use_tqdm=False)
    solo = llm.generate(_ids(prompts[:1]), params, use_tqdm=False)[0]
    assert _bits(pair[0].outputs[0]) == _bits(solo.outputs[0])
    again = llm.generate(_ids([prompts[0] + list(solo.outputs[0].token_ids)]),
                         SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    for i, (token, entries) in enumerate(zip(solo.outputs[0].token_ids, solo.outputs[0].logprobs)):
        assert again.prompt_logprobs[len(prompts[0]) + i][token].logprob == entries[token].logprob


def test_cuda_graph_padding_rows_do_not_change_real_rows(tiny_models):
    """The CUDA-graph decode path run eagerly on CPU (`replay=False`: the padded static buffers a graph replays,
    padding rows pointing at the sink block): bit-identical to the plain eager steps."""
    if DEVICE != "cpu":
        pytest.skip("real graphs are compared with eager in this file's `gpu` tests")
    from replayllm.model_runner_v2.cuda_graph import CudaGraphRunner

    llm = _llm(tiny_models["llama"], max_num_seqs=8, max_cudagraph_capture_size=8, enable_prefix_caching=False)
    prompts = _prompts(8, 5)
    params = SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True)
    eager = [_bits(o.outputs[0]) for o in llm.generate(_ids(prompts), params, use_tqdm=False)]
    runner = llm.llm_engine.runner
    runner.graph_runner = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config,
                                          sink_block=runner.num_blocks, states=runner.req_states, replay=False)
    padded = [_bits(o.outputs[0]) for o in llm.generate(_ids(prompts), params, use_tqdm=False)]
    assert runner.graph_runner.num_replays > 0 and padded == eager


def test_diff_between_two_schedules_is_exactly_zero(tmp_path):
    """`replayllm diff` of the same traces under two batch-invariant schedules (one request at a time with a
    4-token budget vs everything at once without prefix caching) reports Δ = 0 everywhere."""
    if DEVICE != "cpu" or DTYPE != "float32":
        pytest.skip("CPU fp32 case")
    from replayllm.entrypoints.diff import capture, compare

    prompts = ["Once upon a time", "The capital of France is", {"id": "ids", "prompt_token_ids": [785, 6722, 315]}]
    records = capture(prompts, max_tokens=5, top_k=3, device="cpu", dtype="float32", max_model_len=64)
    common = "batch_invariant=true,device=cpu,dtype=float32,max_model_len=64"
    result = compare(records, f"{common},max_num_seqs=1,max_num_batched_tokens=4",
                     f"{common},enable_prefix_caching=false", top_k=3, batch_size=3)
    assert result.overall.num_tokens == 15
    assert result.overall.max_abs_delta == 0.0 and result.overall.num_flips == 0
    assert all(t.rank_a == t.rank_b for t in result.tokens)
    assert result.resolved_a["batch_invariant"] is True and result.resolved_b["batch_invariant"] is True


# -- On CUDA with the compiled kernels (marker `gpu`; bench/gpu_check.sh runs them on the H200): the matmul and
# attention kernels' row-invariance at real shapes, CUDA graphs vs eager, and the Qwen3-0.6B-shaped dummy model in
# bf16 and fp32 (batch 1 vs N, decode logprob == prompt logprob). -------------------------------------------------
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(1024, 3072), (3072, 1024), (2048, 2048), (1024, 151936)])  # narrow and wide tiles
def test_matmul_rows_do_not_depend_on_m(dtype, k, n):
    """A row's bits alone, in a few rows, in hundreds and in thousands: in bf16 the three M buckets of
    `invariant_tile` (SMALL_M_MAX, LARGE_M_MIN) take different tiles, which must sum every element alike."""
    from replayllm.kernels.batch_invariant_matmul import LARGE_M_MIN, SMALL_M_MAX

    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    x = torch.randn(LARGE_M_MIN + 300, k, device="cuda").to(dtype)
    full = batch_invariant_linear_triton(x, w)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(full[:1000].float(), F.linear(x[:1000].float(), w.float()), **tol)
    for m in (1, 3, SMALL_M_MAX, SMALL_M_MAX + 1, 255, 256, 999, LARGE_M_MIN - 1, LARGE_M_MIN):
        assert torch.equal(batch_invariant_linear_triton(x[:m], w), full[:m]), m
    assert torch.equal(batch_invariant_linear_triton(x[500:501], w), full[500:501])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_chunks_and_decode_agree(dtype):
    """Qwen3-0.6B heads (16 q, 8 kv, D=128), block 16: every position of a 300-token prompt gets the same bits
    in a full prefill, in 3 chunks, and as a decode step next to other sequences."""
    torch.manual_seed(1)
    hq, hkv, d, bs, n = 16, 8, 128, 16, 300
    kv = torch.randn(2, 64, bs, hkv, d, device="cuda").to(dtype)
    table = torch.arange(1, 20, dtype=torch.int32, device="cuda")[None]  # blocks 1..19
    q_all = torch.randn(n, hq, d, device="cuda").to(dtype)
    i64 = dict(dtype=torch.int64, device="cuda")

    def run(q, tables, starts, lens):  # starts: cached tokens per row, lens: queries per row
        qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), **i64)
        seq = torch.tensor([s + m for s, m in zip(starts, lens)], **i64)
        return paged_attention_invariant_triton(q, kv, qsl, seq, tables, d**-0.5, max(lens))

    full = run(q_all, table, [0], [n])
    for a, b in ((0, 97), (97, 250), (250, n)):
        assert torch.equal(run(q_all[a:b], table, [a], [b - a]), full[a:b])
    other = torch.arange(30, 49, dtype=torch.int32, device="cuda")[None]  # another sequence's blocks
    for pos in (0, 15, 16, 200, n - 1):
        q = torch.stack([q_all[pos], q_all[7], q_all[pos]])
        out = run(q, torch.cat([table, other, table]), [pos, 250, pos], [1, 1, 1])
        assert torch.equal(out[0], full[pos]) and torch.equal(out[2], full[pos]), pos


def _dummy_llm(dtype: str, **kw) -> LLM:
    """The 0.6B shape with dummy weights. A 4,096-token step budget (the 12 prompts below fit one step): at the
    default 16,384 with trace replay on, an fp32 engine keeps 11.6 GiB for a whole budget's logits, more than
    its share of an 80 GiB card when bench/gpu_check.sh runs five suites at once (REPLAYLLM_TEST_GPU_SHARE)."""
    from replayllm.entrypoints.bench.workload import write_dummy_config

    kw.setdefault("max_num_batched_tokens", 4096)
    return LLM(write_dummy_config(), load_format="dummy", dtype=dtype, max_model_len=1024, skip_tokenizer_init=True,
               batch_invariant=True, enable_trace_replay=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dummy_0_6b_graphs_eager_batch_and_prompt_logprobs(dtype):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.randrange(5, 300))] for _ in range(12)]
    ids = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=24, logprobs=5, ignore_eos=True)
    graphs = _dummy_llm(dtype)
    batch = graphs.generate(ids, params, use_tqdm=False)
    assert graphs.llm_engine.runner.graph_runner.num_replays > 0
    eager = _dummy_llm(dtype, enforce_eager=True, max_num_batched_tokens=128)  # and chunked prefill
    for i in (0, 5, 11):
        solo = eager.generate([ids[i]], params, use_tqdm=False)[0]  # alone, eager, chunked, no async overlap
        assert _bits(solo.outputs[0]) == _bits(batch[i].outputs[0]), i
    full = [{"prompt_token_ids": p + list(o.outputs[0].token_ids)} for p, o in zip(prompts, batch)]
    scored = graphs.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    for prompt, dec, sc in zip(prompts, batch, scored):
        comp = dec.outputs[0]
        for i, (token, entries) in enumerate(zip(comp.token_ids, comp.logprobs)):
            got = sc.prompt_logprobs[len(prompt) + i]
            assert token in got
            assert {t: (lp.logprob, lp.rank) for t, lp in got.items()} == \
                   {t: (lp.logprob, lp.rank) for t, lp in entries.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tiny_graphs_vs_eager(tiny_models, dtype):
    rng = random.Random(4)
    ids = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 50))]} for _ in range(9)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = LLM(tiny_models["qwen3"], dtype=dtype, max_model_len=256, skip_tokenizer_init=True,
                  batch_invariant=True, enforce_eager=eager)
        runs.append([_bits(o.outputs[0]) for o in llm.generate(ids, params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_torch_backend_on_cuda_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        LLM(tiny_models["qwen3"], batch_invariant=True, attention_backend="torch", skip_tokenizer_init=True)
