"""batch_invariant=True on CUDA with the compiled kernels (marker `gpu`; bench/gpu_check.sh runs it on the H200):
the matmul and attention kernels' row-invariance at real shapes, CUDA graphs vs eager, and the Qwen3-0.6B-shaped
dummy model in bf16 and fp32 (batch 1 vs N, decode logprob == prompt logprob). The tiny-model end-to-end file
tests/test_batch_invariant.py is re-run on CUDA in both dtypes by gpu_check.sh as well."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from hf_reference import VOCAB

from replayllm import LLM, SamplingParams
from replayllm.kernels.batch_invariant_attention import paged_attention_invariant_triton
from replayllm.kernels.batch_invariant_matmul import batch_invariant_linear_triton

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(1024, 3072), (3072, 1024), (1024, 151936)])
def test_matmul_rows_do_not_depend_on_m(dtype, k, n):
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    x = torch.randn(1000, k, device="cuda").to(dtype)
    full = batch_invariant_linear_triton(x, w)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), **tol)
    for m in (1, 3, 64, 255, 256, 999):
        assert torch.equal(batch_invariant_linear_triton(x[:m], w), full[:m]), m
    assert torch.equal(batch_invariant_linear_triton(x[500:501], w), full[500:501])


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
    from replayllm.entrypoints.bench.workload import write_dummy_config

    return LLM(write_dummy_config(), load_format="dummy", dtype=dtype, max_model_len=1024, skip_tokenizer_init=True,
               batch_invariant=True, enable_trace_replay=True, **kw)


def _bits(comp) -> tuple:
    return comp.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in comp.logprobs]


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


def test_torch_backend_on_cuda_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        LLM(tiny_models["qwen3"], batch_invariant=True, attention_backend="torch", skip_tokenizer_init=True)
