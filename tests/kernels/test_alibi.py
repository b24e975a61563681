"""ALiBi (BLOOM: each score plus a fixed slope per q head times the key's distance to the query) in every attention
path: the torch backend, the Triton prefill kernel, the split decode (one split, the reduce kernel, the fused
reduce) and both batch-invariant paths, against a dense fp64 reference (tests/helpers/attention_paths.py) (HF's form:
slope * key position added to the scaled scores, which differs from slope * (key - query) by a constant per row).
Under the interpreter on CPU; the compiled kernels in the `gpu` test. Also the slopes against transformers'."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_paths import BS, HKV, HQ, D, dense_reference, every_path
from helpers.tolerances import rounding_tol
from test_paged_attention import SCALE, paged_case
from transformers.models.bloom import modeling_bloom

from replayllm.kernels.paged_attention import paged_prefill_attention_triton
from replayllm.model_runner_v2.models.bloom import alibi_slopes

SLOPES = torch.tensor([0.5, 0.25, 0.0625, 0.9])  # steep enough that the bias outweighs the scores (|s| ~ 1)



CASES = {"prefill": ([3, 9, 1], [0, 14, 30]), "decode": ([1, 1, 1], [2, 22, 40])}


@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_a_dense_reference_with_alibi(monkeypatch, case):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=3)
    ref = dense_reference(q, kv, md, SCALE, alibi=SLOPES)
    plain = dense_reference(q, kv, md, SCALE, alibi=torch.zeros(HQ))
    assert (ref - plain).abs().max() > 0.1  # the biases change the output
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3)
    for name, out in every_path(q, kv, md, SCALE, monkeypatch, "cpu", alibi=SLOPES).items():
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
    ref = dense_reference(q, kv, md, SCALE, alibi=SLOPES)  # the rounded inputs, in fp64
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3) if dtype == torch.float32 else 3 * 2.0**-8
    for name, out in every_path(q, kv, md, SCALE, monkeypatch, "cuda", alibi=SLOPES).items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)
