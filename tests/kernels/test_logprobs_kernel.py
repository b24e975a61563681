"""Raw-logprobs kernel (Triton, under the interpreter on CPU) vs its torch reference vs float64; the sampler
through the engine; on CUDA (marker `gpu`) the compiled kernel at [256, 151936] with timings."""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
import torch
from helpers.tolerances import log_softmax_tol, rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.kernels.logprobs import (
    TOPK_KERNEL_MAX,
    raw_logprobs,
    raw_logprobs_torch,
    raw_logprobs_triton,
    use_triton_logprobs_kernel,
)

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)
IMPLS = [
    pytest.param(partial(raw_logprobs_triton, block_v=256), id="triton", marks=needs_interpreter),
    pytest.param(raw_logprobs_torch, id="torch"),
]


def _check(out, logits, tokens, k):
    """Compare one result with an independent float64 computation on the same (upcast) logits."""
    token_lp, rank, topk_ids, topk_lp = out
    R, V = logits.shape
    x = logits.double()
    lse = x.logsumexp(dim=-1)  # [R]
    x_tok = x.gather(1, tokens[:, None])[:, 0]
    assert token_lp.dtype == torch.float32 and token_lp.shape == (R,)
    tol = log_softmax_tol(logits)
    torch.testing.assert_close(token_lp.double(), x_tok - lse, atol=tol, rtol=0)
    assert rank.dtype == torch.int64
    assert rank.tolist() == [int((x[r] >= x_tok[r]).sum()) for r in range(R)]  # vLLM's: ties count against it
    if k == 0:
        assert topk_ids is None and topk_lp is None
        return
    assert topk_ids.dtype == torch.int64 and topk_ids.shape == (R, k)
    assert topk_lp.dtype == torch.float32 and topk_lp.shape == (R, k)
    for r in range(R):
        ids = topk_ids[r].tolist()
        assert len(set(ids)) == k and all(0 <= i < V for i in ids)
        # the ids' logits are exactly the k largest, in descending order: the ids are the top-k up to ties
        assert x[r, ids].tolist() == x[r].sort(descending=True).values[:k].tolist()
    torch.testing.assert_close(topk_lp.double(), x.gather(1, topk_ids) - lse[:, None], atol=tol, rtol=0)


def _case(R, V, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=gen) * scale
    tokens = torch.randint(0, V, (R,), generator=gen)
    tokens[0] = logits[0].argmax()  # rank 1
    if R > 1:
        tokens[1] = logits[1].argmin()  # rank V
    return logits, tokens


@pytest.mark.parametrize("threads", [2, 4])
def test_torch_rows_keep_their_bits_whatever_the_batch_and_threads(threads):
    """The CPU path's logsumexp: a row's bits do not depend on how many rows share the call, with several threads
    (torch's own logsumexp of one row splits it between threads and moved its last bit: 1.9e-6 in batch-invariant
    mode; the suite runs one thread, OMP_NUM_THREADS=1, so only this test sees it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for V in (151_936, 4_099):  # (torch's logsumexp: rows 23 and 55 of the first moved alone, 2 threads)
            logits, tokens = _case(64, V, seed=V, scale=4.0)
            whole = raw_logprobs_torch(logits, tokens, 3, with_lse=True)
            _check(whole[:4], logits, tokens, 3)
            for rows in (1, 2, 5):
                for start in range(0, 64 - rows + 1, 1 if rows == 1 else 7):
                    part = raw_logprobs_torch(logits[start:start + rows], tokens[start:start + rows], 3, with_lse=True)
                    for got, want in zip(part, whole):
                        assert torch.equal(got, want[start:start + rows])
        empty = raw_logprobs_torch(torch.empty(0, 8), torch.empty(0, dtype=torch.int64), 0, with_lse=True)
        assert empty[4].shape == (0,)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R", [1, 5])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_random_logits_vocab_not_a_multiple_of_the_chunk(impl, R, k):
    logits, tokens = _case(R, 1001, seed=R * 10 + k)  # 4 chunks of 256, the last one 233 long
    out = impl(logits, tokens, k)
    _check(out, logits, tokens, k)
    assert out[1][0] == 1
    if R > 1:
        assert out[1][1] == 1001


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_count_against_the_token_as_vllm(impl):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (4, 700), generator=gen).float()  # 7 distinct values, ~100 copies each
    tokens = torch.tensor([int((logits[r] == v).nonzero()[0]) for r, v in enumerate([3.0, 0.0, -3.0, 1.0])])
    out = impl(logits, tokens, 5)
    _check(out, logits, tokens, 5)
    # tied at the top: every copy of the maximum ranks as many as there are copies (vLLM's (x >= x_tok).sum())
    assert out[1][0] == int((logits[0] == 3).sum()) > 1 and out[1][2] == 700


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_logits_and_an_all_masked_chunk(impl):
    logits, tokens = _case(3, 900, seed=2)
    logits[:, 256:512] = float("-inf")  # a whole chunk of 256
    logits[:, ::7] = float("-inf")
    tokens[2] = 7  # a masked token: logprob -inf, rank = every entry (all are >= -inf; no chunk padding)
    out = impl(logits, tokens, 5)
    _check(out, logits, tokens, 5)
    assert out[0][2] == float("-inf") and out[1][2] == 900


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("V,k", [(37, 37), (300, 300), (1000, TOPK_KERNEL_MAX + 1), (600, TOPK_KERNEL_MAX)])
def test_k_up_to_vocab(impl, V, k):
    # k <= TOPK_KERNEL_MAX: top-k in the kernel (37 = a single chunk with a masked tail); above: torch.topk
    logits, tokens = _case(2, V, seed=V)
    _check(impl(logits, tokens, k), logits, tokens, k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_inputs_are_upcast(impl, dtype):
    logits, tokens = _case(3, 1500, seed=3)
    logits = logits.to(dtype)
    out = impl(logits, tokens, 5)
    _check(out, logits, tokens, 5)  # the float64 check runs on the same rounded values


@pytest.mark.parametrize("impl", IMPLS)
def test_large_logits_and_a_row_strided_view(impl):
    logits, tokens = _case(4, 1300, seed=4, scale=80.0)  # exp would overflow without the max shift
    wide = torch.zeros(4, 1500)
    wide[:, :1300] = logits
    view = wide[:, :1300]  # row stride 1500
    _check(impl(view, tokens, 3), logits, tokens, 3)


@needs_interpreter
def test_triton_matches_reference_and_lse():
    logits, tokens = _case(6, 2000, seed=5)
    got = raw_logprobs_triton(logits, tokens, 4, with_lse=True, block_v=512)
    ref = raw_logprobs_torch(logits, tokens, 4, with_lse=True)
    tol = log_softmax_tol(logits)
    for a, b in zip(got, ref):  # floats within rounding; ranks and top-k ids (integers) exactly
        torch.testing.assert_close(a, b, atol=tol, rtol=0)
    torch.testing.assert_close(got[4], logits.logsumexp(-1), atol=tol, rtol=0)


def test_dispatch_and_validation():
    on_interp = os.environ.get("TRITON_INTERPRET") == "1"
    assert use_triton_logprobs_kernel(torch.device("cpu")) == on_interp
    assert use_triton_logprobs_kernel(torch.device("cuda"))
    logits, tokens = _case(2, 50)
    _check(raw_logprobs(logits, tokens, 2), logits, tokens, 2)
    bad = [
        ((logits.int(), tokens, 1), "logits must be float32"),
        ((logits[0], tokens, 1), "logits must be 2-D"),
        ((logits, tokens.int(), 1), "token_ids must be int64"),
        ((logits, tokens[:1], 1), "token_ids must be int64"),
        ((logits, tokens, 51), "k must be an int"),
        ((logits, tokens, -1), "k must be an int"),
        ((logits, tokens, 1.0), "k must be an int"),
    ]
    for fn in (raw_logprobs_torch, raw_logprobs):
        for args, msg in bad:
            with pytest.raises(ValueError, match=msg):
                fn(*args)
    if on_interp:
        with pytest.raises(ValueError, match="contiguous last dim"):
            raw_logprobs_triton(logits.t().contiguous().t(), tokens, 1)
        with pytest.raises(ValueError, match="power of two"):
            raw_logprobs_triton(logits, tokens, 1, block_v=100)


def test_sampler_logprobs_agree_with_full_rows_through_the_engine():
    # The embedded model (V = 151,936): greedy rows, a trace, a sampled row; logprobs and full rows together.
    llm = LLM(device="cpu", dtype="float32", max_model_len=64, enable_trace_replay=True, skip_tokenizer_init=True)
    params = [SamplingParams(temperature=0, max_tokens=3, logprobs=5, return_full_logprobs=True),
              SamplingParams(trace_decode_token_ids=[5, 6, 7], logprobs=2, return_full_logprobs=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=3, logprobs=3, return_full_logprobs=True)]
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3], [4], [9, 9])]
    for out, p in zip(llm.generate(prompts, params, use_tqdm=False), params):
        comp = out.outputs[0]
        assert len(comp.full_logprobs) == len(comp.token_ids) == 3
        for row, token, lps in zip(comp.full_logprobs, comp.token_ids, comp.logprobs):
            assert lps[token].logprob == row[token]
            assert lps[token].rank == int((row >= row[token]).sum())
            top = sorted((t for t in lps if lps[t].rank <= p.logprobs), key=lambda t: lps[t].rank)
            assert [row[t] for t in top] == sorted(row, reverse=True)[: p.logprobs]
            # Normalised up to the fp32 log-normaliser's rounding: a sum of V terms of total 1.
            assert abs(float(np.log(np.exp(row.astype(np.float64)).sum()))) <= rounding_tol(1, terms=row.size)


# -- CUDA: the compiled kernel at the H200 decode shape -----------------------------------------------------
def _previous_sampler_path(logits, tokens, k):
    """What the sampler did before the kernel (for the timing table): full log_softmax, gather, rank, topk."""
    raw = logits.float().log_softmax(dim=-1)
    token_lp = raw.gather(1, tokens[:, None])
    rank = (raw > token_lp).sum(dim=-1) + 1
    return token_lp, rank, raw.topk(k, dim=-1) if k > 0 else None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_kernel_vs_reference_on_cuda(dtype):
    from replayllm.entrypoints.bench.workload import cuda_ms

    logits, tokens = _case(256, 151_936, seed=6)
    logits, tokens = logits.to("cuda", dtype), tokens.cuda()
    rows = []
    for k in (0, 1, 20):
        got = raw_logprobs_triton(logits, tokens, k)
        ref = raw_logprobs_torch(logits, tokens, k)
        _check([t.cpu() if t is not None else None for t in got], logits.cpu(), tokens.cpu(), k)
        torch.testing.assert_close(got[0], ref[0], atol=log_softmax_tol(logits), rtol=0)
        assert torch.equal(got[1], ref[1])
        rows.append((k, cuda_ms(partial(_previous_sampler_path, logits, tokens, k)),
                     cuda_ms(partial(raw_logprobs_torch, logits, tokens, k)),
                     cuda_ms(partial(raw_logprobs_triton, logits, tokens, k))))
    print(f"\n[raw logprobs cuda] [256, 151936] {dtype}")
    print("   k | today (log_softmax+gather+rank+topk) ms | reference ms | fused ms")
    for k, t_today, t_ref, t_fused in rows:
        print(f"{k:>4} | {t_today:>39.3f} | {t_ref:>12.3f} | {t_fused:>8.3f}")
