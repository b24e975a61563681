"""Chunked attention (Llama 4's `attention_chunk_size` layers: a query at position p sees only the keys of its own
chunk, p // chunk * chunk <= k <= p) in every attention path: the torch backend, the Triton prefill kernel, the split
decode (one split, the reduce kernel, the fused reduce) and both batch-invariant paths, against a dense fp64
reference (tests/helpers/attention_paths.py). Chunks of 6 (not a multiple of the 4-token blocks or of any tile) and
of 16 (a tile boundary). Under the interpreter on CPU; the compiled kernels in the `gpu` test."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_paths import BS, HKV, HQ, D, dense_reference, every_path
from helpers.tolerances import rounding_tol
from test_paged_attention import SCALE, paged_case

from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2.attention import Attention

# prefill: a fresh prompt across three chunks, a chunk continuing a cached context mid-chunk, one decode row at a
# chunk's first position; decode: rows at, just past and well past a chunk boundary
CASES = {"prefill": ([13, 9, 1], [0, 14, 30]), "decode": ([1, 1, 1], [5, 11, 40])}


@pytest.mark.parametrize("chunk", [6, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_matches_a_dense_reference_with_chunks(monkeypatch, case, chunk):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=5)
    ref = dense_reference(q, kv, md, SCALE, chunk=chunk)
    assert (ref - dense_reference(q, kv, md, SCALE)).abs().max() > 0.1  # the chunks change the output
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3)
    outs = every_path(q, kv, md, SCALE, monkeypatch, "cpu", chunk=chunk)
    assert len(outs) == (4 if case == "prefill" else 7)
    for name, out in outs.items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)


def test_a_window_and_chunks_together_are_refused():
    q, kv, md = paged_case(BS, HQ, HKV, D, [1], [5])
    with pytest.raises(ValueError, match="not both"):
        paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE, 1,
                                       window=4, chunk=4)
    with pytest.raises(ValueError, match="not both"):
        paged_decode_attention_triton(q, kv, md.seq_lens, md.block_tables, SCALE, md.max_seq_len, window=4, chunk=4)
    attn = Attention(0, HQ, HKV, D, SCALE)
    attn.set_window(8)
    with pytest.raises(ValueError, match="both a sliding window and attention chunks"):
        attn.set_chunk(8)


def test_chunks_apply_only_where_sequences_outgrow_one():
    """fit_context: an engine whose sequences fit one chunk runs the full causal variants (the same computation)."""
    attn = Attention(0, HQ, HKV, D, SCALE)
    attn.set_chunk(16)
    attn.fit_context(16)
    assert attn.chunk == 0
    attn.fit_context(17)
    assert attn.chunk == 16
    with pytest.raises(ValueError, match="positive integer"):
        attn.set_chunk(0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_kernels_with_chunks(monkeypatch, case, dtype):
    q_lens, ctx = CASES[case]
    q, kv, md = paged_case(BS, HQ, HKV, D, q_lens, ctx, seed=5)
    q, kv = q.to(dtype), kv.to(dtype)
    ref = dense_reference(q, kv, md, SCALE, chunk=6)  # the rounded inputs, in fp64
    # fp32: rounding of the sums; bf16: the output's rounding and the bf16 products' (P rounded before P.V).
    tol = rounding_tol(1, terms=D * md.max_seq_len, steps=3) if dtype == torch.float32 else 3 * 2.0**-8
    for name, out in every_path(q, kv, md, SCALE, monkeypatch, "cuda", chunk=6).items():
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=name)
