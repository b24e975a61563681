"""kernels/prefill_launch.py: the prefill kernel's launch choices and REPLAYLLM_PREFILL_TILE, the override that lets
a GPU run A/B another tile end to end (bench/gpu_check.sh's S1-engine-ptile) without a code change."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import SCALE, _attention_tol, paged_case

from replayllm.kernels import paged_attention as pa
from replayllm.kernels.batch_invariant_attention import paged_attention_invariant_triton
from replayllm.kernels.prefill_launch import prefill_block_q, prefill_override, prefill_tile


@pytest.fixture
def launches(monkeypatch):
    """The constexprs and launch options of every prefill-kernel launch."""
    seen: list[dict] = []
    kernel = pa._paged_prefill_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs)
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
