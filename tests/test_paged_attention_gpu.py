"""Compiled Triton paged attention vs the torch backend on CUDA (marker `gpu`, skipped on CPU; run on the lent
H200 by `bash bench/gpu_check.sh`): kernels on Qwen3-0.6B attention shapes, and whole engines."""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from hf_reference import VOCAB
from test_paged_attention import SCALE, decode, paged_case, prefill

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.bench.workload import cuda_ms, dummy_trace_case
from replayllm.model_runner_v2.attention import paged_attention_torch

pytestmark = pytest.mark.gpu


def _to_cuda(q, kv, md):
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_tables", "token_req_idx", "positions"):
        setattr(md, name, getattr(md, name).cuda())
    return q.cuda(), kv.cuda(), md


def _cases():
    rng = random.Random(0)
    q_lens = [1, 1] + [rng.randrange(2, 512) for _ in range(6)]  # decode rows inside a mixed batch
    ctx = [rng.randrange(0, 1024) for _ in q_lens]
    yield "prefill", prefill, [q_lens, ctx], {}
    for num_seqs, max_len in ((64, 2048), (4, 4096)):  # many sequences: 1 split; few long ones: ~9 splits
        seq_lens = [rng.randrange(1, max_len) for _ in range(num_seqs - 1)] + [max_len]
        yield f"decode{num_seqs}", decode, [[1] * num_seqs, [s - 1 for s in seq_lens]], {}
    yield "decode-7splits", decode, [[1] * 4, [4000, 17, 1, 2500]], {"num_splits": 7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_vs_torch_on_cuda(dtype):
    # Qwen3-0.6B attention: 16 q heads, 8 kv heads, head_dim 128, 16-token blocks.
    for name, fn, lens, kw in _cases():
        q, kv, md = _to_cuda(*paged_case(16, 16, 8, 128, *lens, dtype=dtype))
        out = fn(q, kv, md, **kw)
        ref = paged_attention_torch(q, kv, md, SCALE)
        exact = paged_attention_torch(q.float(), kv.float(), md, SCALE)  # fp32 on the same (rounded) inputs
        d_torch = (out.float() - ref.float()).abs().max().item()
        e_triton = (out.float() - exact).abs().max().item()
        e_torch = (ref.float() - exact).abs().max().item()
        t_triton = cuda_ms(partial(fn, q, kv, md, **kw))
        t_torch = cuda_ms(partial(paged_attention_torch, q, kv, md, SCALE))
        print(f"\n[paged attention cuda] {name} {dtype}: max|triton-torch| {d_torch:.2e}; vs fp32: triton "
              f"{e_triton:.2e}, torch {e_torch:.2e}; {t_triton:.3f} ms vs torch {t_torch:.3f} ms")
        if dtype == torch.float32:
            assert d_torch <= 1e-4
        else:
            assert e_triton <= 0.05


def _generate(path, backend, dtype, prompts, params, **kw):
    llm = LLM(path, device="cuda", dtype=dtype, max_model_len=512, skip_tokenizer_init=True,
              attention_backend=backend, **kw)
    assert llm.llm_engine.config.attention_backend == backend
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _deltas(a, b) -> torch.Tensor:
    return torch.tensor([abs(x[t].logprob - y[t].logprob) for ca, cb in zip(a, b)
                         for x, y, t in zip(ca.logprobs, cb.logprobs, ca.token_ids)])


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_engine_triton_vs_torch_on_cuda(tiny_models, arch):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 16, 17, 33, 64, 90, 300)]
    traces = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    replay = [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces]

    def run(backend, dtype):  # (greedy completions under chunked prefill, trace-replay completions)
        out = (_generate(tiny_models[arch], backend, dtype, prompts, greedy, max_num_batched_tokens=128),
               _generate(tiny_models[arch], backend, dtype, prompts, replay, enable_trace_replay=True))
        assert [c.token_ids for c in out[1]] == traces
        return out

    fp32 = {b: run(b, "float32") for b in ("torch", "triton")}
    d32 = torch.cat([_deltas(fp32["torch"][i], fp32["triton"][i]) for i in (0, 1)])
    same_greedy = [c.token_ids for c in fp32["torch"][0]] == [c.token_ids for c in fp32["triton"][0]]
    bf16 = {b: run(b, "bfloat16") for b in ("torch", "triton")}
    d16 = _deltas(bf16["torch"][1], bf16["triton"][1])
    err = {b: _deltas(bf16[b][1], fp32["torch"][1]) for b in bf16}  # bf16 engines vs the fp32 one, same traces
    print(f"\n[attention backend cuda] {arch}: fp32 triton vs torch |dlogprob| mean {d32.mean():.2e} max "
          f"{d32.max():.2e}, same greedy tokens {same_greedy}; bf16 triton vs torch mean {d16.mean():.2e} max "
          f"{d16.max():.2e}; bf16 vs fp32: torch mean {err['torch'].mean():.2e} max {err['torch'].max():.2e}, "
          f"triton mean {err['triton'].mean():.2e} max {err['triton'].max():.2e}")
    assert same_greedy and d32.max() <= 1e-4
    # bf16: the Triton kernels are no less accurate than torch's bf16 attention, measured against fp32.
    assert err["triton"].mean() <= 1.5 * err["torch"].mean() + 1e-3


def test_qwen3_0_6b_dummy_bf16_triton_vs_torch():
    path, prompts, traces = dummy_trace_case(2, (7, 64, 200, 511, 700, 900))
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
                  max_model_len=1024, max_num_seqs=8, enable_trace_replay=True, attention_backend=backend)
        runs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
        assert [c.token_ids for c in runs[backend]] == traces
        del llm
    d = _deltas(runs["torch"], runs["triton"])
    print(f"\n[attention backend cuda] qwen3-0.6B dummy bf16: trace |dlogprob| triton vs torch mean {d.mean():.2e} "
          f"max {d.max():.2e} over {d.numel()} tokens")
    assert torch.isfinite(d).all() and d.max() < 0.5
    auto = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
               max_model_len=64, max_num_seqs=8)
    assert auto.llm_engine.config.attention_backend == "triton"  # "auto" on CUDA
