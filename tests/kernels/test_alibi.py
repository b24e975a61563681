"""ALiBi (BLOOM: each score plus a fixed slope per q head times the key's distance to the query) in every attention
path: the torch backend, the Triton prefill kernel, the split decode (one split, the reduce kernel, the fused
reduce) and both batch-invariant paths, against a dense plain-torch reference written here in fp64 (HF's form:
slope * key position added to the scaled scores, which differs from slope * (key - query) by a constant per row).
Under the interpreter on CPU; the compiled kernels in the `gpu` test. Also the slopes against transformers'."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol
from test_paged_attention import SCALE, paged_case
from transformers.models.bloom import modeling_bloom

from replayllm.kernels import decode_launch as dl
from replayllm.kernels.batch_invariant_attention import (
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2.attention import paged_attention_torch
from replayllm.model_runner_v2.models.bloom import alibi_slopes

HQ, HKV, D, BS = 4, 2, 16, 4
SLOPES = torch.tensor([0.5, 0.25, 0.0625, 0.9])  # steep enough that the bias outweighs the scores (|s| ~ 1)


def dense_with_alibi(q, kv, md, slopes) -> torch.Tensor:
    """Every query token's causal attention, one request at a time, in fp64, scores + slope * key position."""
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    flat = kv.double().reshape(2, -1, HKV, D)
    for b, n in enumerate(seq_lens):
        slots = [int(md.block_tables[b, j // BS]) * BS + j % BS for j in range(n)]
        k, v = (flat[c][slots].repeat_interleave(HQ // HKV, 1) for c in (0, 1))  # [n, Hq, D]
        rows = q[qsl[b]:qsl[b + 1]].double()
        positions = torch.arange(n - rows.shape[0], n)
        kj = torch.arange(n)
        s = torch.einsum("qhd,khd->hqk", rows, k) * SCALE + slopes.double().view(HQ, 1, 1) * kj  # [Hq, Q, n]
        s = s.masked_fill(~(kj[None] <= positions[:, None]), float("-inf"))
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def _every_path(q, kv, md, slopes, monkeypatch, device) -> dict[str, torch.Tensor]:
    on = {"device": device}
    q_, kv_, slopes_ = q.to(**on), kv.to(**on), slopes.to(**on)
    tables, lens, qsl = md.block_tables.to(**on), md.seq_lens.to(**on), md.query_start_loc.to(**on)
    outs = {"prefill": paged_prefill_attention_triton(q_, kv_, qsl, lens, tables, SCALE, md.max_query_len,
                                                      alibi=slopes_),
            "invariant-triton": paged_attention_invariant_triton(q_, kv_, qsl, lens, tables, SCALE,
                                                                 md.max_query_len, alibi=slopes_)}
    if device == "cpu":
        outs["torch"] = paged_attention_torch(q, kv, md, SCALE, alibi=slopes)
        outs["invariant-torch"] = paged_attention_invariant_torch(q, kv, md.token_req_idx, md.positions,
                                                                  md.block_tables, SCALE, md.max_seq_len,
                                                                  alibi=slopes)
    if md.max_query_len == 1:
        for splits in (1, 4):
            outs[f"decode-{splits}"] = paged_decode_attention_triton(q_, kv_, lens, tables, SCALE, md.max_seq_len,
                                                                     splits, alibi=slopes_)
        monkeypatch.setattr(dl, "FUSED_REDUCE", True)
        monkeypatch.setattr(dl, "_COUNTERS", {})
        outs["decode-fused-reduce"] = paged_decode_attention_triton(q_, kv_, lens, tables, SCALE, md.max_seq_len,
                                                                    4, alibi=slopes_)
    return {name: out.cpu() for name, out in outs.items()}


CASES = {"prefill": ([3, 9, 1], [0, 14, 30]), "decode": ([1, 1, 1], [2, 22, 40])}


@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_a_dense_reference_with_alibi(monkeypatch, case):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    ref = dense_with_alibi(q, kv, md, SLOPES)
    assert (ref - dense_with_alibi(q, kv, md, torch.zeros(HQ))).abs().max() > 0.1  # the biases change the output
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3)
    for name, out in _every_path(q, kv, md, SLOPES, monkeypatch, "cpu").items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)


def test_alibi_is_checked():
    q, kv, md = paged_case(BS, HQ, HKV, D, [1], [5])
    for bad in (torch.zeros(HQ + 1), torch.zeros(HQ, dtype=torch.float16)):
        with pytest.raises(ValueError, match="one fp32 slope per q head"):
            paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE, 1,
                                           alibi=bad)


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 71, 112])
def test_slopes_are_transformers(heads):
    """BLOOM's slopes for power-of-two and other head counts (bloom-560m 16, bloom 112), bit for bit."""
    assert torch.equal(alibi_slopes(heads), modeling_bloom._get_alibi_slopes(heads, torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_kernels_with_alibi(monkeypatch, case, dtype):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    q, kv = q.to(dtype), kv.to(dtype)
    ref = dense_with_alibi(q, kv, md, SLOPES)  # the rounded inputs, in fp64
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3) if dtype == torch.float32 else 3 * 2.0**-8
    for name, out in _every_path(q, kv, md, SLOPES, monkeypatch, "cuda").items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)
