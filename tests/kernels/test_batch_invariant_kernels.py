"""Batch-invariant kernels (CPU): the torch paths and the Triton kernels (interpreter) against torch references,
and bitwise row-invariance: a row's result is the same alone, in a batch of any size, at any position."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import rounding_tol

from replayllm.kernels.activation import sigmoid, silu, silu_and_mul_invariant_torch, softplus
from replayllm.kernels.batch_invariant_attention import (
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from replayllm.kernels.batch_invariant_matmul import (
    LARGE_M_MIN,
    NARROW_MAX_N,
    SMALL_M_MAX,
    TILE_16BIT_NARROW,
    TILE_16BIT_SMALL,
    TILE_16BIT_WIDE,
    TILE_FP32,
    TILE_INTERPRET,
    batch_invariant_linear_torch,
    batch_invariant_linear_triton,
    invariant_tile,
)
from replayllm.model_runner_v2.attention import paged_attention_torch
from replayllm.model_runner_v2.forward_context import AttentionMetadata


def _rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    """fn applied to each row of x on its own (a fresh, aligned copy), stacked."""
    return torch.cat([fn(x[i : i + 1].clone()) for i in range(x.shape[0])])


def test_cpu_primitives_the_torch_paths_rely_on():
    """The CPU invariant paths use torch.exp / log / rsqrt elementwise and sums over a contiguous last dim. These
    must give an element the same bits in a tensor's SIMD body and in its scalar tail, and a row's sum must not
    depend on the rows around it. (torch.exp2 and F.silu fail the first on AVX-512, hence exp and the explicit
    SiLU.) If this fails on a new CPU, the batch-invariant CPU path is not invariant there."""
    torch.manual_seed(0)
    x = torch.randn(3000) * 4
    for fn in (torch.exp, torch.log, torch.rsqrt):
        arg = x.abs() + 1e-3 if fn is not torch.exp else x
        body = fn(arg)
        alone = torch.stack([fn(arg[i : i + 1])[0] for i in range(300)])
        assert torch.equal(body[:300], alone), fn.__name__
    for k in (32, 100, 4097):
        m = torch.randn(70, k)
        assert torch.equal(m.sum(-1), _rows_alone(lambda r: r.sum(-1), m))
        assert torch.equal(m.logsumexp(-1), _rows_alone(lambda r: r.logsumexp(-1), m))


def test_invariant_sigmoid_silu_softplus_give_each_element_its_bits_anywhere():
    """kernels/activation.py's sigmoid / silu / softplus with invariant=True (batch_invariant mode: the hybrid
    models' gates, Qwen2-MoE's shared-expert gate): an element's result alone equals its result inside a tensor
    (SIMD body or scalar tail); and each stays within a few roundings of torch's own function."""
    torch.manual_seed(0)
    x = torch.randn(3000) * 6
    for fn, ref in ((sigmoid, torch.sigmoid), (silu, F.silu),
                    (softplus, F.softplus)):
        body = fn(x, True)
        alone = torch.stack([fn(x[i : i + 1].clone(), True)[0] for i in range(300)])
        assert torch.equal(body[:300], alone), fn.__name__
        scale = ref(x).abs().clamp(min=1.0)  # relative error of O(1) values, absolute near 0
        assert ((body - ref(x)).abs() / scale).max().item() <= rounding_tol(1, steps=4), fn.__name__


@pytest.mark.parametrize("k,n,bias", [(64, 96, True), (100, 70, False), (1024, 40, False)])
def test_linear_torch_is_row_invariant(k, n, bias):
    torch.manual_seed(1)
    w, b = torch.randn(n, k), (torch.randn(n) if bias else None)
    x = torch.randn(300, k)
    full = batch_invariant_linear_torch(x, w, b)
    ref = F.linear(x, w, b)
    torch.testing.assert_close(full, ref, rtol=0, atol=rounding_tol(ref, terms=k))  # length-k dots, other order
    alone = _rows_alone(lambda r: batch_invariant_linear_torch(r, w, b), x[:40])
    for m in (1, 2, 3, 17, 40):  # a batch of m rows, and the same rows shifted inside a larger batch
        assert torch.equal(batch_invariant_linear_torch(x[:m], w, b), alone[:m]), m
    assert torch.equal(batch_invariant_linear_torch(x[7:300], w, b)[:33], alone[7:40])
    assert torch.equal(full[:40], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_triton_matches_torch_and_is_row_invariant(dtype):
    torch.manual_seed(2)
    k, n = 80, 70  # ragged against every tile size
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(70, k).to(dtype)
    got = batch_invariant_linear_triton(x, w, b)
    assert got.dtype == dtype and got.shape == (70, n)
    ref = F.linear(x.float(), w.float(), b.float())
    # fp32: length-k dots in another order. bf16 (fp32 accumulation): the output's one bf16 rounding, at most
    # 2^-8 relative; rtol 2e-2 is 5x that, atol 0.1 for entries near 0 (unchanged).
    tol = dict(rtol=0, atol=rounding_tol(ref, terms=k)) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-1)
    torch.testing.assert_close(got.float(), ref, **tol)
    for m in (1, 5, 33):  # 1, 5 and 33 rows: one and two row tiles
        assert torch.equal(batch_invariant_linear_triton(x[:m], w, b), got[:m]), m
    assert torch.equal(batch_invariant_linear_triton(x[3:4], w, b), got[3:4])


@pytest.mark.parametrize("tile", [TILE_16BIT_NARROW, TILE_16BIT_WIDE])
def test_linear_triton_cuda_tiles_under_the_interpreter(tile):
    """The CUDA bf16 tiles (BLOCK_K 128 and 64 against a ragged K of 200), run by the interpreter: right sums,
    and the rows of a 1-row call and a 70-row call are the same bits."""
    torch.manual_seed(3)
    k, n = 200, 40
    w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(70, k).to(torch.bfloat16)
    got = batch_invariant_linear_triton(x, w, tile=tile)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=1e-1)
    for m in (1, 33):
        assert torch.equal(batch_invariant_linear_triton(x[:m], w, tile=tile), got[:m]), m


def test_invariant_tile_by_weight_device_and_rows():
    """N, dtype, the device's shared memory and (16-bit on CUDA only) the row count choose the tile: narrow for a
    few rows, and up to NARROW_MAX_N columns below LARGE_M_MIN rows; wide otherwise; a GPU whose shared memory
    cannot hold the pipelined tiles gets the small one for every M; fp32 and the interpreter one tile for every
    M. (That rows keep their bits across the buckets is a GPU test: tests/engine/test_batch_invariant.py.)"""
    h200, sm86 = 232448, 101376
    for rows in (1, SMALL_M_MAX):
        assert invariant_tile(151936, torch.bfloat16, h200, rows) == TILE_16BIT_NARROW
    assert invariant_tile(NARROW_MAX_N, torch.bfloat16, h200, SMALL_M_MAX + 1) == TILE_16BIT_NARROW
    assert invariant_tile(NARROW_MAX_N, torch.bfloat16, h200, LARGE_M_MIN - 1) == TILE_16BIT_NARROW
    assert invariant_tile(NARROW_MAX_N, torch.bfloat16, h200, LARGE_M_MIN) == TILE_16BIT_WIDE
    assert invariant_tile(NARROW_MAX_N + 1, torch.float16, h200, 256) == TILE_16BIT_WIDE
    assert invariant_tile(4096, torch.bfloat16, 0, 256) == TILE_16BIT_WIDE  # not reported: the measured tiles
    assert invariant_tile(4096, torch.bfloat16, sm86, 256) == TILE_16BIT_WIDE  # 96 KiB fits
    for rows in (1, 256, LARGE_M_MIN):
        assert invariant_tile(4096, torch.bfloat16, 64 * 1024, rows) == TILE_16BIT_SMALL
        assert invariant_tile(151936, torch.float32, h200, rows) == TILE_FP32
        assert invariant_tile(1024, torch.bfloat16, None, rows) == TILE_INTERPRET


def test_linear_rejects_bad_input():
    with pytest.raises(ValueError, match="weight"):
        batch_invariant_linear_torch(torch.randn(2, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype"):
        batch_invariant_linear_torch(torch.randn(2, 4), torch.randn(3, 4).double())


def test_silu_invariant_matches_and_is_row_invariant():
    torch.manual_seed(3)
    x = torch.randn(50, 2 * 37) * 3
    got = silu_and_mul_invariant_torch(x)
    gate, up = x.chunk(2, dim=-1)
    tol = rounding_tol(1, steps=4)  # exp, + 1, /, *: four roundings per element, in another order than F.silu's
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=tol, atol=tol)
    assert torch.equal(got, _rows_alone(silu_and_mul_invariant_torch, x))


# -- attention ------------------------------------------------------------------------------------------------
BLOCK, HKV, GROUP, D = 4, 2, 2, 16


def _cache(num_blocks: int = 40) -> torch.Tensor:
    torch.manual_seed(4)
    return torch.randn(2, num_blocks, BLOCK, HKV, D)


def _md(reqs: list[tuple[list[int], int, int]]) -> AttentionMetadata:
    """reqs: (block ids, tokens cached before this step, tokens this step) per request."""
    q_lens = [n for _, _, n in reqs]
    seq_lens = [c + n for _, c, n in reqs]
    width = max(len(b) for b, _, _ in reqs)
    tables = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in reqs], dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    token_req = torch.cat([torch.full((n,), i) for i, n in enumerate(q_lens)])
    positions = torch.cat([torch.arange(c, c + n) for _, c, n in reqs])
    slots = torch.cat([tables[i, positions[token_req == i] // BLOCK].long() * BLOCK + positions[token_req == i] % BLOCK
                       for i in range(len(reqs))])
    return AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens), slot_mapping=slots,
                             block_tables=tables, token_req_idx=token_req, positions=positions,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens))


def _queries(md: AttentionMetadata, table_of: list[list[int]]) -> torch.Tensor:
    """A query per scheduled token that depends only on (the request's first block, its position): the same
    token gets the same q in every schedule."""
    rows = []
    for tok in range(md.positions.shape[0]):
        gen = torch.Generator().manual_seed(1000 * table_of[int(md.token_req_idx[tok])][0] + int(md.positions[tok]))
        rows.append(torch.randn(HKV * GROUP, D, generator=gen))
    return torch.stack(rows)


def _run(impl: str, reqs) -> dict[tuple[int, int], torch.Tensor]:
    """(request's first block, position) -> output row, for every token scheduled in `reqs`."""
    kv, md = _cache(), _md(reqs)
    q = _queries(md, [b for b, _, _ in reqs])
    if impl == "torch":
        out = paged_attention_invariant_torch(q, kv, md.token_req_idx, md.positions, md.block_tables, D**-0.5,
                                              md.max_seq_len)
    else:
        out = paged_attention_invariant_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, D**-0.5,
                                               md.max_query_len)
    ref = paged_attention_torch(q, kv, md, D**-0.5)
    # Another attention implementation: q.k over D, softmax and weighted sum over up to max_seq_len keys.
    torch.testing.assert_close(out, ref, rtol=0, atol=rounding_tol(ref, terms=md.max_seq_len, steps=2))
    firsts = [b[0] for b, _, _ in reqs]
    return {(firsts[int(r)], int(p)): out[t] for t, (r, p) in enumerate(zip(md.token_req_idx, md.positions))}


A = list(range(0, 12))  # request A: 45 tokens in blocks 0..11
B = list(range(20, 28))  # request B: up to 30 tokens in blocks 20..27


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_attention_same_bits_in_every_schedule(impl):
    """A token's output is bit-identical in a full prefill, in chunks of any size (its earlier keys read from
    the cache), as a decode step, alone or next to another request of another length."""
    full = _run(impl, [(A, 0, 45)])
    schedules = [
        [(A, 0, 13), (A, 13, 32)],  # two prefill chunks
        [(A, 0, 44), (A, 44, 1)],  # prefill then the last token as a decode
        [(A, 40, 5)],  # a prefix hit: 40 tokens cached, 5 computed
    ]
    for steps in schedules:
        for step in steps:
            for key, row in _run(impl, [step]).items():
                assert torch.equal(row, full[key]), (steps, key)
    mixed = _run(impl, [(B, 0, 30), (A, 30, 15)])  # another request's prefill in the same step
    mixed.update(_run(impl, [(B, 29, 1), (A, 44, 1), (B, 3, 1)]))  # decodes of three lengths
    for key, row in mixed.items():
        if key[0] == A[0]:
            assert torch.equal(row, full[key]), key
    b_full = _run(impl, [(B, 0, 30)])
    assert torch.equal(mixed[(B[0], 29)], b_full[(B[0], 29)])


def test_attention_bf16_tile_same_bits_across_key_tiles(monkeypatch):
    """bf16 takes the fixed TILE_16BIT (BLOCK_N 128 keys): a 300-token request walks three key tiles, and every
    position gets the same bits in a full prefill, in chunks cut inside a tile, and as decodes beside another
    request (the interpreter runs the kernel: CPU)."""
    import replayllm.kernels.batch_invariant_attention as bia

    seen, launch = [], bia.paged_prefill_attention_triton

    def spy(*a, **kw):
        seen.append(kw["tile"])
        return launch(*a, **kw)

    monkeypatch.setattr(bia, "paged_prefill_attention_triton", spy)
    torch.manual_seed(5)
    n, blocks = 300, list(range(1, 76))  # 75 blocks of 4 = 300 keys
    kv = torch.randn(2, 90, BLOCK, HKV, D).to(torch.bfloat16)
    q_all = torch.randn(n, HKV * GROUP, D).to(torch.bfloat16)
    table = torch.tensor([blocks], dtype=torch.int32)

    def run(q, tables, starts, lens):  # starts: cached tokens per request, lens: its queries this step
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        seq = torch.tensor([s + m for s, m in zip(starts, lens)])
        return paged_attention_invariant_triton(q, kv, qsl, seq, tables, D**-0.5, max(lens))

    full = run(q_all, table, [0], [n])
    assert seen == [bia.TILE_16BIT]
    for a, b in ((0, 100), (100, 131), (131, n)):  # chunk edges off the 128-key tiles
        assert torch.equal(run(q_all[a:b], table, [a], [b - a]), full[a:b])
    other = torch.tensor([list(range(76, 90)) + [0] * 61], dtype=torch.int32)  # another request's 14 blocks
    for pos in (0, 127, 128, 255, 256, n - 1):
        out = run(torch.stack([q_all[7], q_all[pos]]), torch.cat([other, table]), [40, pos], [1, 1])
        assert torch.equal(out[1], full[pos]), pos
    # A device whose shared memory cannot hold the 128-key K/V stages (24 KiB at head_dim 16; at 128, 192 KiB: more
    # than an A100's 163) keeps the launcher's tile.
    monkeypatch.setattr(bia, "max_shared_memory", lambda device: 16 * 1024)
    seen.clear()
    run(q_all[:5], table, [0], [5])
    assert seen == [None]
