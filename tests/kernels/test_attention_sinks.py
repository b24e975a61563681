"""Attention sinks (GPT-OSS: one learned logit per q head in the softmax's denominator, attached to no value) in
every attention path: the torch backend, the Triton prefill kernel, the split decode (one split, the reduce kernel,
the fused reduce) and both batch-invariant paths, against a dense plain-torch reference written here (softmax over
[scores, sink], the sink's column dropped). With and without a sliding window (GPT-OSS's layers alternate). Under
the interpreter on CPU; the compiled kernels in the `gpu` test."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol
from test_paged_attention import SCALE, paged_case

from replayllm.kernels import decode_launch as dl
from replayllm.kernels.batch_invariant_attention import (
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2.attention import paged_attention_torch

HQ, HKV, D, BS = 4, 2, 16, 4


def dense_with_sinks(q, kv, md, sinks, window: int = 0) -> torch.Tensor:
    """Every query token's attention, one request and head at a time, in fp64: keys 0..p (and > p - window)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    flat = kv.double().reshape(2, -1, HKV, D)
    for b, n in enumerate(seq_lens):
        slots = [int(md.block_tables[b, j // BS]) * BS + j % BS for j in range(n)]
        k, v = (flat[c][slots].repeat_interleave(HQ // HKV, 1) for c in (0, 1))  # [n, Hq, D]
        rows = q[qsl[b]:qsl[b + 1]].double()
        positions = torch.arange(n - rows.shape[0], n)
        s = torch.einsum("qhd,khd->hqk", rows, k) * SCALE  # [Hq, Q, n]
        kj = torch.arange(n)
        seen = kj[None] <= positions[:, None]
        if window:
            seen &= kj[None] > positions[:, None] - window
        s = s.masked_fill(~seen, float("-inf"))
        column = sinks.double().view(HQ, 1, 1).expand(-1, s.shape[1], 1)
        p = torch.cat((s, column), -1).softmax(-1)[..., :-1]
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def _every_path(q, kv, md, sinks, window, monkeypatch, device) -> dict[str, torch.Tensor]:
    on = {"device": device}
    q_, kv_, sinks_ = q.to(**on), kv.to(**on), sinks.to(**on)
    tables, lens, qsl = md.block_tables.to(**on), md.seq_lens.to(**on), md.query_start_loc.to(**on)
    outs = {"prefill": paged_prefill_attention_triton(q_, kv_, qsl, lens, tables, SCALE, md.max_query_len,
                                                      window=window, sinks=sinks_),
            "invariant-triton": paged_attention_invariant_triton(q_, kv_, qsl, lens, tables, SCALE,
                                                                 md.max_query_len, window, sinks=sinks_)}
    if device == "cpu":
        outs["torch"] = paged_attention_torch(q, kv, md, SCALE, window=window, sinks=sinks)
        outs["invariant-torch"] = paged_attention_invariant_torch(q, kv, md.token_req_idx, md.positions,
                                                                  md.block_tables, SCALE, md.max_seq_len, window,
                                                                  sinks=sinks)
    if md.max_query_len == 1:
        for splits in (1, 4):
            outs[f"decode-{splits}"] = paged_decode_attention_triton(q_, kv_, lens, tables, SCALE, md.max_seq_len,
                                                                     splits, window=window, sinks=sinks_)
        monkeypatch.setattr(dl, "FUSED_REDUCE", True)
        monkeypatch.setattr(dl, "_COUNTERS", {})
        outs["decode-fused-reduce"] = paged_decode_attention_triton(q_, kv_, lens, tables, SCALE, md.max_seq_len,
                                                                    4, window=window, sinks=sinks_)
    return {name: out.cpu() for name, out in outs.items()}


CASES = {"prefill": ([3, 9, 1], [0, 14, 30]), "decode": ([1, 1, 1], [2, 22, 40])}


@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_a_dense_reference_with_sinks(monkeypatch, case, window):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    # Sinks from well below to well above the scores (|s| ~ 1): the sink's share runs from ~0 to most of the mass.
    sinks = torch.tensor([-4.0, 0.0, 1.5, 6.0])
    ref = dense_with_sinks(q, kv, md, sinks, window)
    plain = dense_with_sinks(q, kv, md, torch.full((HQ,), -1e4), window)  # no sink: the mass stays on the keys
    assert (ref - plain).abs().max() > 0.1  # the sinks change the output
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3)
    for name, out in _every_path(q, kv, md, sinks, window, monkeypatch, "cpu").items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)


def test_sinks_are_checked():
    q, kv, md = paged_case(BS, HQ, HKV, D, [1], [5])
    with pytest.raises(ValueError, match="one float per q head"):
        paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE, 1,
                                       sinks=torch.zeros(HQ + 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_kernels_with_sinks(monkeypatch, case, dtype):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    sinks = torch.tensor([-4.0, 0.0, 1.5, 6.0])
    q, kv = q.to(dtype), kv.to(dtype)
    ref = dense_with_sinks(q, kv, md, sinks.to(dtype), 5)  # the rounded inputs, in fp64
    # fp32: rounding of the sums; bf16: the output's rounding and the bf16 products' (P rounded before P.V).
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3) if dtype == torch.float32 else 3 * 2.0**-8
    for name, out in _every_path(q, kv, md, sinks.to(dtype), 5, monkeypatch, "cuda").items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)
