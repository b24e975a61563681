"""GPU checks (marker `gpu`; skipped on CPU): parity with HF in fp32 and bf16 on CUDA, a 0.6B dummy model."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_rank, load_hf, teacher_forced

from replayllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPTS = [[(i * 37 + j * 11) % 500 + 3 for j in range(n)] for i, n in enumerate([1, 5, 16, 17, 33, 64, 90, 128])]


def _engine(path, dtype, **kw):
    return LLM(path, device="cuda", dtype=dtype, max_model_len=256, skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_cuda_parity_with_hf(tiny_models, arch, dtype):
    torch_dtype = getattr(torch, dtype)
    llm = _engine(tiny_models[arch], dtype)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1), use_tqdm=False)
    hf = load_hf(tiny_models[arch], torch_dtype).to("cuda")
    deltas, rank_mismatch = [], 0
    for prompt, out in zip(PROMPTS, outs):
        comp = out.outputs[0]
        lp, _ = teacher_forced(hf, prompt, comp.token_ids)
        for i, t in enumerate(comp.token_ids):
            deltas.append(abs(comp.logprobs[i][t].logprob - float(lp[i, t])))
            rank_mismatch += comp.logprobs[i][t].rank != hf_rank(lp[i], t)
    d = torch.tensor(deltas)
    print(f"\n[gpu parity] {arch} {dtype}: mean |dlogprob| {d.mean():.3e}, max {d.max():.3e}, "
          f"rank mismatches {rank_mismatch}/{len(deltas)}")
    if dtype == "float32":
        assert d.max() <= 1e-4
    else:
        # bf16 rounding differs between our kernels and HF's; tiny random models have large logits (|x| ~ 10+),
        # so one ulp of bf16 is ~0.06: the bound is a few ulps.
        assert d.mean() <= 0.02 and d.max() <= 0.25


def test_cuda_trace_replay_bf16_and_fp32(tiny_models):
    prompt = PROMPTS[3]
    trace = [7, 2, 400, 13, 2, 99] * 5
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = _engine(tiny_models["qwen3"], dtype, enable_trace_replay=True)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == trace
        results[dtype] = [out.logprobs[i][t].logprob for i, t in enumerate(trace)]
        # Replaying the engine's own greedy output one token per step reproduces its logprobs bit for bit. The
        # greedy run computes its whole prompt, as the replay does (the trace run above cached the prompt's blocks:
        # a greedy run reading them would compute its first token in a shorter prefill, another computation).
        g = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=20, logprobs=0,
                                                                         ignore_eos=True,
                                                                         skip_reading_prefix_cache=True),
                         use_tqdm=False)[0].outputs[0]
        r = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=g.token_ids,
                                                                         logprobs=0, trace_replay_chunk_size=1),
                         use_tqdm=False)[0].outputs[0]
        assert [x[t].logprob for x, t in zip(g.logprobs, g.token_ids)] == \
               [x[t].logprob for x, t in zip(r.logprobs, r.token_ids)]
    hf = load_hf(tiny_models["qwen3"]).to("cuda")
    lp, _ = teacher_forced(hf, prompt, trace)
    ref = [float(lp[i, t]) for i, t in enumerate(trace)]
    assert max(abs(a - b) for a, b in zip(results["float32"], ref)) <= 1e-4
    assert 0 < max(abs(a - b) for a, b in zip(results["bfloat16"], ref)) < 0.2


def test_dummy_qwen3_0_6b_generates():
    from replayllm.entrypoints.bench.workload import write_dummy_config as write_config

    llm = LLM(write_config(), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
              max_model_len=1024, enable_trace_replay=True)
    outs = llm.generate([{"prompt_token_ids": list(range(100, 164))}] * 4,
                        [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)] * 3
                        + [SamplingParams(trace_decode_token_ids=list(range(500, 532)), logprobs=1)], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert outs[3].outputs[0].token_ids == list(range(500, 532))
    import math

    assert all(math.isfinite(lp[t].logprob) for o in outs for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids))


def test_dummy_weights_are_the_same_bits_on_cpu_and_cuda():
    """load_format="dummy" hashes each value from its place in the model on the parameter's device: the CPU and
    CUDA give the same weights (dummy runs stay comparable across devices), across chunk boundaries too."""
    from replayllm.model_runner_v2 import loader

    n = loader._HASH_CHUNK["cpu"] * 3 + 12_345  # several CPU chunks, one CUDA chunk
    cpu = loader._hash_uniform(7, n, 3, torch.device("cpu"))
    cuda = loader._hash_uniform(7, n, 3, torch.device("cuda"))
    assert torch.equal(cpu, cuda.cpu())
    assert -1.0 <= float(cpu.min()) and float(cpu.max()) < 1.0 and abs(float(cpu.mean())) < 1e-3


def test_cuda_defaults_are_the_fast_path(tiny_models):
    # A new user's LLM(...) on CUDA: CUDA graphs, triton attention and async scheduling, with no option named.
    cfg = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_model_len=128).llm_engine.config
    assert cfg.async_scheduling is True and cfg.use_cuda_graphs and cfg.attention_backend == "triton"
