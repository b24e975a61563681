"""kernels/prefill_launch.py: the prefill kernel's launch choices and REPLAYLLM_PREFILL_TILE, the override that lets
a GPU run A/B another tile end to end (bench/gpu_check.sh's S1-engine-ptile) without a code change; the kernel's
numbering of its programs (`prefill_grid`, `find_query_block`)."""

from __future__ import annotations

import random

import pytest
import torch
from test_paged_attention import SCALE, _attention_tol, paged_case

from replayllm.kernels import paged_attention as pa
from replayllm.kernels.batch_invariant_attention import paged_attention_invariant_triton
from replayllm.kernels.prefill_launch import prefill_block_q, prefill_grid, prefill_override, prefill_tile
from replayllm.model_runner_v2.attention import paged_attention_torch


@pytest.fixture
def launches(monkeypatch):
    """The constexprs and launch options of every prefill-kernel launch."""
    seen: list[dict] = []
    kernel = pa._paged_prefill_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(dict(kwargs, grid=grid, blocks_per_req=args[7]))
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(pa, "_paged_prefill_kernel", Spy())
    return seen


def _run(q, kv, md):
    return pa.paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
                                             md.max_query_len)


def test_the_override_sets_block_q_and_tile(monkeypatch, launches):
    q, kv, md = paged_case(4, 4, 2, 32, [1, 7, 20], [0, 0, 37])
    default = _run(q, kv, md)
    assert launches[-1]["BLOCK_Q"] == prefill_block_q(20, 2) == 32
    assert (launches[-1]["BLOCK_N"], launches[-1]["num_warps"]) == prefill_tile(torch.float32, 32)[:2]
    monkeypatch.setenv("REPLAYLLM_PREFILL_TILE", "8,16,2,2")
    out = _run(q, kv, md)
    got = launches[-1]
    assert (got["BLOCK_Q"], got["BLOCK_N"], got["num_warps"], got["num_stages"]) == (8, 16, 2, 2)
    torch.testing.assert_close(out, default, atol=_attention_tol(default, md), rtol=0)  # another summation order


def test_the_override_leaves_fixed_tiles_alone(monkeypatch, launches):
    # Batch-invariant mode fixes its block_q and tile: an override must not change what it promises.
    q, kv, md = paged_case(4, 4, 2, 32, [1, 7], [0, 5])
    args = (q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE, md.max_query_len)
    before = paged_attention_invariant_triton(*args)
    monkeypatch.setenv("REPLAYLLM_PREFILL_TILE", "8,16,2,2")
    after = paged_attention_invariant_triton(*args)
    assert launches[0] == launches[1] and torch.equal(before, after)


@pytest.mark.parametrize("text", ["32,32,4", "a,b,c,d", "0,32,4,3"])
def test_a_malformed_override_is_an_error(monkeypatch, text):
    monkeypatch.setenv("REPLAYLLM_PREFILL_TILE", text)
    with pytest.raises(ValueError, match="REPLAYLLM_PREFILL_TILE"):
        prefill_override()


def test_a_mixed_step_launches_a_program_per_query_block_not_per_row_times_the_longest(launches):
    # 40 decode rows beside a 300-token prompt: numbered by request, 41 x 10 programs per kv head, 390 of them
    # empty; the flat numbering needs 340 // 32 + 41 = 51.
    q_lens = [1] * 40 + [300]
    q, kv, md = paged_case(4, 4, 2, 16, q_lens, [23] * 40 + [0], seed=3)
    out = _run(q, kv, md)
    assert launches[-1]["BLOCK_Q"] == 32
    assert prefill_grid(340, 41, 300, 32) == (51, 0)
    assert (launches[-1]["grid"], launches[-1]["blocks_per_req"]) == ((51, 2), 0)
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(out, ref, atol=_attention_tol(ref, md), rtol=0)


def test_uniform_rows_keep_the_numbering_by_request(launches):
    # Decode steps (and a CUDA graph's capture of them), uniform prefills: B x blocks, nothing spare, no search.
    assert prefill_grid(256, 256, 1, 8) == (256, 1)
    assert prefill_grid(16 * 512, 16, 512, 32) == (256, 16)
    q, kv, md = paged_case(4, 4, 2, 16, [40, 40, 40], [0, 9, 3], seed=4)
    _run(q, kv, md)
    assert (launches[-1]["grid"], launches[-1]["blocks_per_req"]) == ((6, 2), 2)


@pytest.mark.parametrize("block_q", [1, 2, 4, 8])
def test_both_numberings_find_every_query_block_and_compute_the_same_bits(monkeypatch, launches, block_q):
    # Ragged lengths around the block size, 20 rows so the binary search walks several levels: every output row
    # must be written and right (the output buffer starts uninitialised: a missed block would be garbage), and the
    # two numberings (REPLAYLLM_PREFILL_GRID forces each) must give the same bits (a program's arithmetic does not
    # depend on its number).
    rng = random.Random(block_q)
    q_lens = [max(1, block_q + d) for d in (-1, 0, 1, 2 * block_q - 1, 3)] + [rng.randint(1, 12) for _ in range(15)]
    ctx = [rng.choice([0, 0, 5, 17]) for _ in q_lens]
    q, kv, md = paged_case(4, 4, 2, 16, q_lens, ctx, seed=block_q)
    outs = {}
    for numbering in ("flat", "request"):
        monkeypatch.setenv("REPLAYLLM_PREFILL_GRID", numbering)
        outs[numbering] = pa.paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables,
                                                            SCALE, md.max_query_len, block_q=block_q, tile=(16, 1, 1))
        assert (launches[-1]["blocks_per_req"] == 0) == (numbering == "flat")
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(outs["flat"], ref, atol=_attention_tol(ref, md), rtol=0)
    assert torch.equal(outs["flat"], outs["request"])


def test_an_unknown_numbering_is_an_error(monkeypatch):
    monkeypatch.setenv("REPLAYLLM_PREFILL_GRID", "diagonal")
    with pytest.raises(ValueError, match="REPLAYLLM_PREFILL_GRID must be one of auto, flat, request"):
        prefill_grid(64, 2, 40, 32)


def test_a_request_computes_the_same_bits_alone_and_in_a_batch():
    # A program's work depends on its (request, query block) only, not on its number in the grid: what
    # batch-invariant mode relies on (the fixed block_q and tile it passes). The batch is numbered flat here, each
    # request alone by request.
    q_lens, ctx = [1, 9, 33, 1, 4], [40, 0, 3, 7, 0]
    assert prefill_grid(48, 5, 33, 8)[1] == 0
    q, kv, md = paged_case(4, 4, 2, 16, q_lens, ctx, seed=5)
    fixed = dict(block_q=8, tile=(16, 1, 1))
    batch = pa.paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
                                              md.max_query_len, **fixed)
    starts = md.query_start_loc.tolist()
    for b, n in enumerate(q_lens):
        alone = pa.paged_prefill_attention_triton(
            q[starts[b] : starts[b] + n], kv, torch.tensor([0, n]), md.seq_lens[b : b + 1], md.block_tables[b : b + 1],
            SCALE, n, **fixed)
        assert torch.equal(alone, batch[starts[b] : starts[b] + n]), b
