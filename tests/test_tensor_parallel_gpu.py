"""tensor_parallel_size=2 with NCCL on two GPUs (marker `gpu`; skipped, with the reason, on fewer than two):
TP=2 vs TP=1 on the tiny fp32 models (both attention backends) and on a Qwen3-0.6B-shaped dummy model in bf16
(TP=2 dummy weights are the TP=1 model sharded). Numbers printed, bounds asserted.
Run on the two-GPU kind: `GPU_TESTS=tests/test_tensor_parallel_gpu.py SKIP_E2E=1 bash bench/gpu_check.sh`."""

from __future__ import annotations

import gc
import multiprocessing
import random

import pytest
import torch

from replayllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"tensor_parallel_size=2 needs 2 GPUs, found {torch.cuda.device_count()}"),
]
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
