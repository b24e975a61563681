"""Attention sinks (GPT-OSS: one learned logit per q head in the softmax's denominator, attached to no value) in
every attention path: the torch backend, the Triton prefill kernel, the split decode (one split, the reduce kernel,
the fused reduce) and both batch-invariant paths, against a dense fp64 reference (tests/helpers/attention_paths.py:
softmax over [scores, sink], the sink's column dropped). With and without a sliding window (GPT-OSS's layers
alternate). Under the interpreter on CPU; the compiled kernels in the `gpu` test."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_paths import BS, HKV, HQ, D, dense_reference, every_path
from helpers.tolerances import rounding_tol
from test_paged_attention import SCALE, paged_case

from replayllm.kernels.paged_attention import paged_prefill_attention_triton

CASES = {"prefill": ([3, 9, 1], [0, 14, 30]), "decode": ([1, 1, 1], [2, 22, 40])}


@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_a_dense_reference_with_sinks(monkeypatch, case, window):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    # Sinks from well below to well above the scores (|s| ~ 1): the sink's share runs from ~0 to most of the mass.
    sinks = torch.tensor([-4.0, 0.0, 1.5, 6.0])
    ref = dense_reference(q, kv, md, SCALE, window, sinks=sinks)
    # no sink: the mass stays on the keys
    plain = dense_reference(q, kv, md, SCALE, window, sinks=torch.full((HQ,), -1e4))
    assert (ref - plain).abs().max() > 0.1  # the sinks change the output
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3)
    for name, out in every_path(q, kv, md, SCALE, monkeypatch, "cpu", window, sinks=sinks).items():
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
    ref = dense_reference(q, kv, md, SCALE, 5, sinks=sinks.to(dtype))  # the rounded inputs, in fp64
    # fp32: rounding of the sums; bf16: the output's rounding and the bf16 products' (P rounded before P.V).
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3) if dtype == torch.float32 else 3 * 2.0**-8
    for name, out in every_path(q, kv, md, SCALE, monkeypatch, "cuda", 5, sinks=sinks.to(dtype)).items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)
