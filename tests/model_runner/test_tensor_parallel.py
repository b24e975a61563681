"""tensor_parallel_size=2 on CPU (gloo, two processes) against tensor_parallel_size=1: greedy tokens and
logprobs (fp32: within rounding, tolerances.LOGPROB_TOL), trace replay, int8, sleep mode, clean shutdown, the
server; NCCL on two GPUs at the end (marker `gpu`). The worker processes' lifecycle (bad sizes, a collected
engine, a killed or failing worker): test_tp_workers.py; Ctrl-C: test_tensor_parallel_ctrl_c.py.

Worker start-up costs seconds, so every TP=2 engine is shared: `runs` builds each configuration once (one TP=2
engine alive at a time: one torch.distributed group per process) and the tests assert on its results."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest
import torch
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.models.parallel import RowParallelLinear, VocabParallelEmbedding, full_to_local
from replayllm.model_runner_v2.quantization.int8 import Int8Linear

PROMPTS = [[5, 6, 7, 8], list(range(10, 47)), [random.Random(1).randrange(512) for _ in range(70)]]
NUM_TOKENS = 10
FP32_BOUND = LOGPROB_TOL  # TP=2 vs TP=1, fp32: only the summation order of the row-parallel reduce differs
# int8 TP=2 quantizes each rank's shard of o_proj/down_proj with its own per-row scales (over its columns), so
# it is a different quantization than int8 TP=1; both stay within int8's documented bound vs fp32 (4.5).
INT8_BOUND = 4.5


def _engine_kwargs(**extra) -> dict:
    return dict(device="cpu", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                enable_trace_replay=True, seed=0, **extra)


def _logprobs(completion) -> list[float]:
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


def _run(llm: LLM) -> dict:
    """Greedy continuations, then trace replay of (greedy continuation, random sequence) per prompt."""
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=1),
                          use_tqdm=False)
    rng = random.Random(7)
    traces = [list(g.outputs[0].token_ids) for g in greedy] + [[rng.randrange(512) for _ in range(NUM_TOKENS)]
                                                               for _ in PROMPTS]
    trace_prompts = prompts + prompts
    # One token per step: the TP=1 vs TP=2 bound is for the same computation (fast replay over HTTP below).
    replay = llm.generate(trace_prompts, [SamplingParams(trace_decode_token_ids=t, logprobs=1,
                                                         trace_replay_chunk_size=1) for t in traces],
                          use_tqdm=False)
    return {
        "greedy_tokens": [list(o.outputs[0].token_ids) for o in greedy],
        "greedy_lp": [_logprobs(o.outputs[0]) for o in greedy],
        "traces": traces,
        "replay_tokens": [list(o.outputs[0].token_ids) for o in replay],
        "replay_lp": [_logprobs(o.outputs[0]) for o in replay],
    }


@pytest.fixture(scope="module")
def runs(tiny_models):
    """(model, quantization, tp) -> results of `_run`; plus layer facts seen on the TP=2 engines."""
    out, facts = {}, {}
    for model, quant in (("qwen3", None), ("qwen2", None), ("qwen2", "int8"), ("qwen2", "dummy")):
        for tp in (1, 2):
            # "dummy": seeded random weights drawn in full shapes, then sharded (loader.fill_dummy_weights).
            extra = dict(load_format="dummy") if quant == "dummy" else dict(quantization=quant)
            llm = LLM(tiny_models[model], **_engine_kwargs(tensor_parallel_size=tp, **extra))
            out[(model, quant, tp)] = _run(llm)
            if quant == "dummy":
                facts[("params", tp)] = dict(llm.llm_engine.runner.model.named_parameters())
            if tp == 2:
                layer = llm.llm_engine.runner.model.model.layers[0]
                facts[(model, quant)] = {
                    "o_proj": type(layer.self_attn.o_proj).__name__,
                    "o_proj_inner": type(getattr(layer.self_attn.o_proj, "inner", None)).__name__,
                    "embed": isinstance(llm.llm_engine.runner.model.model.embed_tokens, VocabParallelEmbedding),
                    "num_heads": layer.self_attn.num_heads,
                    "num_kv_heads": layer.self_attn.num_kv_heads,
                    "kv_cache_heads": llm.llm_engine.runner.runner.kv_caches[0].shape[3],
                    "worker_pids": llm.llm_engine.runner.worker_pids,
                }
                llm.llm_engine.shutdown()
            del llm
            gc.collect()
    return out, facts


def _max_delta(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("model", ["qwen3", "qwen2"])
def test_tp2_matches_tp1_fp32(runs, model):
    out, facts = runs
    one, two = out[(model, None, 1)], out[(model, None, 2)]
    assert two["greedy_tokens"] == one["greedy_tokens"]
    assert all(len(t) == NUM_TOKENS for t in two["greedy_tokens"])
    greedy_delta = _max_delta(one["greedy_lp"], two["greedy_lp"])
    replay_delta = _max_delta(one["replay_lp"], two["replay_lp"])
    print(f"{model} fp32 TP=2 vs TP=1: max |Δlogprob| greedy {greedy_delta:.2e}, replay {replay_delta:.2e}")
    assert greedy_delta <= FP32_BOUND and replay_delta <= FP32_BOUND
    # The TP=2 engine really sharded: half the heads, half the KV heads in the cache, vocab-parallel embedding.
    f = facts[(model, None)]
    assert (f["num_heads"], f["num_kv_heads"], f["kv_cache_heads"]) == (2, 1, 1)
    assert f["embed"] and f["o_proj"] == RowParallelLinear.__name__


@pytest.mark.parametrize("model", ["qwen3", "qwen2"])
def test_tp2_trace_replay_emits_the_trace(runs, model):
    out, _ = runs
    two = out[(model, None, 2)]
    assert two["replay_tokens"] == two["traces"]
    assert all(len(lp) == NUM_TOKENS for lp in two["replay_lp"])


def test_tp2_int8(runs):
    out, facts = runs
    fp32, int8_1, int8_2 = out[("qwen2", None, 1)], out[("qwen2", "int8", 1)], out[("qwen2", "int8", 2)]
    assert int8_2["replay_tokens"] == int8_2["traces"]
    # Same trace set as fp32 (the greedy part is the fp32 continuation only if int8 agrees; compare the
    # random half, which is the same sequence under every config).
    n = len(PROMPTS)
    assert int8_2["traces"][n:] == fp32["traces"][n:]
    vs_fp32 = _max_delta(fp32["replay_lp"][n:], int8_2["replay_lp"][n:])
    vs_int8_1 = _max_delta(int8_1["replay_lp"][n:], int8_2["replay_lp"][n:])
    print(f"qwen2 int8 TP=2: max |Δlogprob| vs fp32 {vs_fp32:.3f}, vs int8 TP=1 {vs_int8_1:.3f}")
    assert 0 < vs_fp32 <= INT8_BOUND
    assert 0 < vs_int8_1 <= INT8_BOUND  # local per-shard scales: a different (still int8) quantization
    f = facts[("qwen2", "int8")]
    assert f["o_proj_inner"] == Int8Linear.__name__  # the quantized shard keeps its all-reduce wrapper


def test_tp2_dummy_weights_are_the_tp1_model(runs):
    out, facts = runs
    one, two = out[("qwen2", "dummy", 1)], out[("qwen2", "dummy", 2)]
    n = len(PROMPTS)  # the random traces (greedy picks on near-uniform dummy logits may differ by ties)
    assert two["replay_tokens"][n:] == one["traces"][n:] == two["traces"][n:]
    delta = _max_delta(one["replay_lp"][n:], two["replay_lp"][n:])
    print(f"qwen2 dummy weights TP=2 vs TP=1: max |Δlogprob| {delta:.2e}")
    assert delta <= FP32_BOUND
    # Rank 0 holds exactly its shard of the TP=1 dummy model (q/k/v and gate/up parts split one by one).
    full, rank0 = facts[("params", 1)], facts[("params", 2)]
    assert full.keys() == rank0.keys()
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # qwen2 tiny: 4 q heads + 2 kv heads of 16 -> full rows q [0, 64), k [64, 96), v [96, 128); rank 0 holds
    # q heads 0-1, k head 0, v head 0.
    assert full[qkv].shape == (128, 64) and rank0[qkv].shape == (64, 64)
    assert torch.equal(rank0[qkv][:32], full[qkv][:32]) and torch.equal(rank0[qkv][32:48], full[qkv][64:80])
    assert torch.equal(rank0[qkv][48:], full[qkv][96:112])
    for name, param in rank0.items():
        assert torch.equal(param, full_to_local(param, full[name])), name


def test_workers_gone_after_shutdown(runs):
    _, facts = runs
    pids = [pid for f in facts.values() for pid in f.get("worker_pids", [])]
    assert len(pids) == 4
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]


def test_tp2_sleep_level_2_and_reload_from_disk(tiny_models):
    """Sleep mode under tensor parallelism: every rank gives its memory back (the call returns after all have),
    level 2 discards every rank's shard, and the checkpoint reloaded from disk (each rank slicing its own) gives
    the same tokens and logprobs as before, exactly (the same computation on the same weights)."""
    llm = LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=2, enable_sleep_mode=True))
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, skip_reading_prefix_cache=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    before = [(o.outputs[0].token_ids, _logprobs(o.outputs[0])) for o in llm.generate(prompts, params,
                                                                                       use_tqdm=False)]
    llm.sleep(2)
    assert llm.llm_engine.runner.runner.sleep_mode.params.released
    llm.wake_up(["weights"])
    assert not any(p.any() for p in llm.llm_engine.runner.model.parameters())  # rank 0's shard: discarded
    assert llm.llm_engine.update_weights_from_disk(tiny_models["qwen3"]) > 0
    llm.wake_up(["kv_cache"])
    after = [(o.outputs[0].token_ids, _logprobs(o.outputs[0])) for o in llm.generate(prompts, params,
                                                                                      use_tqdm=False)]
    assert after == before
    llm.shutdown()


def test_server_with_tensor_parallel_size_2(tiny_models, runs):
    from fastapi.testclient import TestClient

    from replayllm.config import EngineConfig
    from replayllm.entrypoints.cli.engine_args import engine_kwargs
    from replayllm.entrypoints.cli.main import build_parser
    from replayllm.entrypoints.openai.api_server import build_app

    args = build_parser().parse_args(["serve", tiny_models["qwen3"], "--tensor-parallel-size", "2", "--device",
                                      "cpu", "--max-model-len", "256", "--skip-tokenizer-init",
                                      "--enable-trace-replay", "--dtype", "float32"])
    kwargs = engine_kwargs(args)
    assert kwargs["tensor_parallel_size"] == 2
    out, _ = runs
    expected = out[("qwen3", None, 2)]
    app = build_app(EngineConfig(model=args.model, **kwargs))
    engine = app.state.async_engine.engine
    with TestClient(app) as client:
        body = {"model": engine.config.served_model_name, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS,
                "temperature": 0, "return_token_ids": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected["greedy_tokens"][0]
        trace = expected["traces"][len(PROMPTS)]
        r = client.post("/v1/completions", json={**body, "trace_decode_token_ids": trace, "logprobs": 1,
                                                 "trace_replay_chunk_size": 64})  # fast replay (not the default)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == trace
        with pytest.raises(RuntimeError, match="already initialised"):  # one TP group per process at a time
            LLM(tiny_models["qwen3"], **_engine_kwargs(tensor_parallel_size=2))
    engine.shutdown()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]


def test_server_engine_core_process_with_tensor_parallel_size_2(tiny_models, runs):
    """`replayllm serve`'s mode: the engine core process drives its own TP worker processes; all stop with it."""
    from fastapi.testclient import TestClient

    from replayllm.config import EngineConfig
    from replayllm.engine.core_client import EngineCoreClient
    from replayllm.entrypoints.cli.engine_args import engine_kwargs
    from replayllm.entrypoints.cli.main import build_parser
    from replayllm.entrypoints.openai.api_server import build_app

    args = build_parser().parse_args(["serve", tiny_models["qwen3"], "--tensor-parallel-size", "2", "--device",
                                      "cpu", "--max-model-len", "256", "--skip-tokenizer-init",
                                      "--enable-trace-replay", "--dtype", "float32"])
    out, _ = runs
    expected = out[("qwen3", None, 2)]
    core = EngineCoreClient(EngineConfig(model=args.model, **engine_kwargs(args)))
    core.start_core()
    core_pid = core.core_pid
    with TestClient(build_app(engine_client=core)) as client:
        body = {"model": core.config.served_model_name, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS,
                "temperature": 0, "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == expected["greedy_tokens"][0]
        trace = expected["traces"][len(PROMPTS)]
        r = client.post("/v1/completions", json={"model": body["model"], "prompt": PROMPTS[0], "logprobs": 1,
                                                 "trace_decode_token_ids": trace, "return_token_ids": True,
                                                 "trace_replay_chunk_size": 64})  # fast replay (not the default)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == trace
        # Utility calls run in the core between steps: nothing left there, every KV block free.
        assert client.portal.call(core.call_utility, "num_requests") == 0
        snapshot = client.portal.call(core.call_utility, "snapshot")
        assert snapshot[3] == snapshot[2] > 0  # num_free_kv_blocks == num_kv_blocks
        with pytest.raises(RuntimeError, match="unknown utility method 'step'"):
            client.portal.call(core.call_utility, "step")
    assert not Path(f"/proc/{core_pid}").exists()  # stopped and reaped by the app's lifespan end


def test_both_runners_implement_the_runner_interface():
    """The engine calls only RunnerInterface methods; the tensor-parallel runner forwards nothing implicitly."""
    import numpy as np

    from replayllm.model_runner_v2.async_output import AsyncModelRunnerOutput
    from replayllm.model_runner_v2.model_runner import ModelRunner
    from replayllm.model_runner_v2.runner_interface import RunnerInterface
    from replayllm.model_runner_v2.tp_workers import TensorParallelRunner
    from replayllm.step_io import ModelRunnerOutput

    for cls in (ModelRunner, TensorParallelRunner):
        assert issubclass(cls, RunnerInterface) and not cls.__abstractmethods__
    assert "__getattr__" not in vars(TensorParallelRunner)
    out = ModelRunnerOutput(["a"], np.array([5]))
    assert AsyncModelRunnerOutput.completed(out).get() is out  # what TP's sample_tokens returns


# -- NCCL on two GPUs (marker `gpu`; skipped, with the reason, on fewer than two): TP=2 vs TP=1 on the tiny fp32 models
# (both backends) and a Qwen3-0.6B-shaped bf16 dummy (TP=2 weights: the TP=1 model sharded). On the two-GPU kind:
# `GPU_TWINS=tests/model_runner/test_tensor_parallel.py SKIP_E2E=1 SKIP_SPEC=1 bash bench/gpu_check.sh`. ----------
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"tensor_parallel_size=2 needs 2 GPUs, found {torch.cuda.device_count()}")
TINY_FP32_BOUND = 1e-4  # fp32 on CUDA: reduce order + GEMM splits differ between the layouts
DUMMY_BF16_BOUNDS = {"mean": 0.01, "max": 0.05}


def _lps(completion) -> list[float]:
    return [d[t].logprob for t, d in zip(completion.token_ids, completion.logprobs)]


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], torch.tensor([_lps(o.outputs[0]) for o in outs])


def _close(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model", ["qwen3", "qwen2"])
def test_tiny_fp32_tp2_matches_tp1(tiny_models, model, backend):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (3, 17, 40, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    runs = {}
    for tp in (1, 2):
        llm = LLM(tiny_models[model], device="cuda", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                  enable_trace_replay=True, attention_backend=backend, tensor_parallel_size=tp,
                  kv_cache_memory_bytes=1 << 28)
        tokens, lp = _generate(llm, prompts, greedy)
        traces = [[rng.randrange(512) for _ in range(16)] for _ in prompts] if tp == 1 else runs[1][2]
        replay_tokens, replay_lp = _generate(llm, prompts, [SamplingParams(trace_decode_token_ids=t, logprobs=1)
                                                            for t in traces])
        assert replay_tokens == traces
        runs[tp] = (tokens, lp, traces, replay_lp)
        _close(llm)
    assert runs[2][0] == runs[1][0]
    d_greedy = (runs[2][1] - runs[1][1]).abs().max().item()
    d_replay = (runs[2][3] - runs[1][3]).abs().max().item()
    print(f"\n[TP=2 NCCL] {model} fp32 {backend}: max |dlogprob| greedy {d_greedy:.2e}, replay {d_replay:.2e}")
    assert d_greedy <= TINY_FP32_BOUND and d_replay <= TINY_FP32_BOUND
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]


@pytest.mark.gpu
@TWO_GPUS
def test_dummy_qwen3_0_6b_bf16_tp2_vs_tp1():
    from replayllm.entrypoints.bench.workload import dummy_trace_case

    path, prompts, traces = dummy_trace_case(0, (1, 16, 64, 200, 333, 512), low=0, high=151_000)
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces]
    results = {}
    for tp, quant in ((1, None), (2, None), (2, "int8")):
        llm = LLM(path, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                  max_model_len=1024, enable_trace_replay=True, tensor_parallel_size=tp, quantization=quant,
                  kv_cache_memory_bytes=1 << 30)
        tokens, lp = _generate(llm, prompts, params)
        assert tokens == traces
        results[(tp, quant)] = lp
        _close(llm)
    for key in ((2, None), (2, "int8")):
        d = (results[key] - results[(1, None)]).abs()
        print(f"\n[TP=2 NCCL] 0.6B dummy bf16 {key}: mean |dlogprob| {d.mean():.3e}, max {d.max():.3e} "
              f"over {d.numel()} tokens")
        assert d.mean() <= DUMMY_BF16_BOUNDS["mean"] and d.max() <= DUMMY_BF16_BOUNDS["max"]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("replayllm-tp")]
