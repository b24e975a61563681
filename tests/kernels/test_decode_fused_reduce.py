"""The split decode's fused reduce (`REPLAYLLM_DECODE_FUSED_REDUCE=1`, kernels/decode_launch.py): the last split
program of each (sequence, kv head) combines the partials itself, no reduce kernel. Against the two-kernel path
and the torch reference, under the interpreter; on CUDA (`gpu`): many launches, and replays of a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import SCALE, _attention_tol, _to_cuda, paged_case

from replayllm.kernels import decode_launch as dl
from replayllm.kernels import paged_attention as pa
from replayllm.kernels.paged_attention import paged_decode_attention_triton
from replayllm.model_runner_v2.attention import paged_attention_torch


@pytest.fixture
def reduce_calls(monkeypatch):
    """Launches of the reduce kernel, counted (the launch itself still runs)."""
    calls = []
    kernel = pa._paged_decode_reduce_kernel

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]

    monkeypatch.setattr(pa, "_paged_decode_reduce_kernel", Counting())
    return calls


def _fused(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(dl, "FUSED_REDUCE", on)


@pytest.mark.parametrize("case", [
    ((16, 4, 2, 32), [1], [299], 32),  # W4 in small: one sequence, 32 splits (most of them empty)
    ((4, 6, 2, 16), [1, 1, 1], [40, 3, 130], 5),  # a group of 3; a context shorter than its split count
    ((16, 8, 8, 32), [1, 1], [70, 500], 7),  # no GQA
], ids=["batch1-32splits", "group3", "mha"])
def test_the_fused_reduce_equals_the_reduce_kernel(monkeypatch, reduce_calls, case):
    shape, q_lens, ctx, splits = case
    q, kv, md = paged_case(*shape, q_lens, ctx, seed=7)
    args = (q, kv, md.seq_lens, md.block_tables, SCALE, md.max_seq_len, splits)
    _fused(monkeypatch, False)
    two_kernels = paged_decode_attention_triton(*args)
    assert len(reduce_calls) == 1
    _fused(monkeypatch, True)
    monkeypatch.setattr(dl, "_COUNTERS", {})
    fused = paged_decode_attention_triton(*args)
    assert len(reduce_calls) == 1  # no reduce launch
    # The same partials and the same combine (combine_splits), in the same order under the interpreter.
    assert torch.equal(fused, two_kernels)
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(fused, ref, atol=_attention_tol(ref, md), rtol=0)
    # Every (sequence, kv head)'s counter was zeroed again by its last program: the next launch starts clean.
    counters = dl._COUNTERS[q.device]
    assert counters.numel() >= len(q_lens) * shape[2] and not counters.any()
    assert torch.equal(paged_decode_attention_triton(*args), fused)


def test_one_split_and_the_default_use_no_counters(monkeypatch, reduce_calls):
    q, kv, md = paged_case(16, 4, 2, 32, [1], [299], seed=3)
    _fused(monkeypatch, True)
    monkeypatch.setattr(dl, "_COUNTERS", {})
    paged_decode_attention_triton(q, kv, md.seq_lens, md.block_tables, SCALE, md.max_seq_len, 1)
    assert dl._COUNTERS == {} and reduce_calls == []
    _fused(monkeypatch, False)
    assert dl.decode_counters(q.device, 8) is None


def test_split_counts_are_bounded(monkeypatch):
    q, kv, md = paged_case(16, 4, 2, 32, [1], [299], seed=3)
    with pytest.raises(ValueError, match="num_splits must be in"):
        paged_decode_attention_triton(q, kv, md.seq_lens, md.block_tables, SCALE, md.max_seq_len,
                                      dl.DECODE_MAX_SPLITS + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_reduce_on_cuda_many_launches_and_graph_replays(monkeypatch, batch):
    """Qwen3-0.6B heads (16 q, 8 kv, head_dim 128), bf16, 32 splits of a 4,096-key graph length: 200 eager
    launches and 200 replays of a captured launch, each equal to the first fused result (a partial read before
    its writer's store was visible would change it), close to the two-kernel path, counters zero at the end."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, kv, md = _to_cuda(*paged_case(16, 16, 8, 128, [1] * batch, [300 + 97 * b for b in range(batch)],
                                     dtype=torch.bfloat16, seed=11))
    args = (q, kv, md.seq_lens, md.block_tables, SCALE, 4096, 32)
    _fused(monkeypatch, False)
    two_kernels = paged_decode_attention_triton(*args)
    _fused(monkeypatch, True)
    monkeypatch.setattr(dl, "_COUNTERS", {})
    first = paged_decode_attention_triton(*args)
    torch.cuda.synchronize()
    print(f"\n[fused reduce cuda] batch {batch}: bit-equal to the reduce kernel: {torch.equal(first, two_kernels)}, "
          f"max diff {(first.float() - two_kernels.float()).abs().max().item():.2e}")
    torch.testing.assert_close(first, two_kernels, atol=2 ** -7, rtol=0)
    for _ in range(200):
        assert torch.equal(paged_decode_attention_triton(*args), first)
    graph, out = torch.cuda.CUDAGraph(), None
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            out = paged_decode_attention_triton(*args)
    for _ in range(200):
        graph.replay()
        assert torch.equal(out, first)
    torch.cuda.synchronize()
    assert not dl._COUNTERS[q.device].any()
