"""fp8 KV caches (EngineConfig.kv_cache_dtype) at the kernel level: the write rounds exactly as torch's clamp + cast
(bit for bit, Triton vs torch), and every attention path reads an fp8 cache exactly as the same values in q's
dtype (bit for bit: the kernels convert each tile before its dots); the fp8 variants compile for an sm_90 target
(no GPU needed). The engine against transformers: tests/engine/test_fp8_kv_cache_e2e.py. The compiled kernels on
CUDA: the `gpu`-marked test at the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from test_paged_attention import SCALE, paged_case

import replayllm
from replayllm.kernels.batch_invariant_attention import (
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from replayllm.kernels.kv_cache_read import gather_kv
from replayllm.kernels.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.kernels.rounding import FP8_CODES, FP8_MAX, round_to_fp8
from replayllm.model_runner_v2.attention import paged_attention_torch

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, FP8_CODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok)
    tl.store(out_ptr + offs, round_to_fp8(x, FP8_CODE).to(out_ptr.dtype.element_ty), mask=ok)


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, every midpoint between neighbours (the ties) and just beside it, values
    beyond the largest, +-0, +-inf, and random values from far below the smallest subnormal to far above the max."""
    finite = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = finite[finite.isfinite()].unique()  # sorted, one zero
    mids = (finite[1:] + finite[:-1]) / 2  # exact in fp32
    beside = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    g = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(2000, generator=g) * 10.0 ** e for e in range(-7, 7)])
    big = FP8_MAX[dtype] * torch.tensor([1.0001, 1.1, 2.0, 1e3])
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e38, -3e38])
    return torch.cat([finite, mids, beside, -mids, -beside, spread, big, -big, special])


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_round_to_fp8_is_torchs_clamp_and_cast(dtype):
    x = _edge_values(dtype)
    out = torch.empty(x.numel(), dtype=dtype)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), FP8_CODE=FP8_CODES[dtype], BLOCK=1024)
    limit = FP8_MAX[dtype]
    ref = x.clamp(-limit, limit).to(dtype)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))  # ties to even, saturation, -0 kept
    assert out.float().abs().max() == limit


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_cache_fp8_matches_reference(src_dtype, cache_dtype):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 4, 2, 32, 7
    g = torch.Generator().manual_seed(3)
    kv = (torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g) * 40).to(src_dtype)  # beyond e4m3's max
    kv[0, 0, :4] = torch.tensor([1e-5, -1e-5, 0.0, 1e6])  # underflow to +-0, saturation
    k, v = kv[:, :num_kv_heads], kv[:, 2 * num_kv_heads:]  # strided views, as split from the projection
    slots = torch.tensor([9, 2, 13, 0, 17, 5, 6])
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
    ref = cache.clone()
    write_kv_cache_triton(cache, k, v, slots)
    write_kv_cache_torch(ref, k, v, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    limit = FP8_MAX[cache_dtype]
    assert torch.equal(flat[0][slots].float(), k.float().clamp(-limit, limit).to(cache_dtype).float())
    assert torch.equal(flat[1][slots].float(), v.float().clamp(-limit, limit).to(cache_dtype).float())
    assert flat[0].float().abs().max() == limit  # saturated, not inf or NaN


def _paged(dtype, cache_dtype, q_lens, ctx_lens, device="cpu", seed=0, shape=(4, 4, 2, 32)):
    """test_paged_attention's case (default: 4 q heads over 2 kv heads of 32, block size 4, scrambled tables) with
    an fp8 cache, on `device`. shape: (block size, q heads, kv heads, head dim)."""
    q, kv, md = paged_case(*shape, q_lens, ctx_lens, seed=seed)
    kv8 = (kv * 3).to(cache_dtype)  # values of a few units: the fp8 grid is coarse there, so a wrong read shows
    to = dict(device=device)
    md = type(md)(**{f: (getattr(md, f).to(**to) if isinstance(getattr(md, f), torch.Tensor) else getattr(md, f))
                     for f in md.__dataclass_fields__})
    return q.to(dtype).to(**to), kv8.to(**to), md


def _paths(q, kv, md):
    """Every attention path over the step: name -> output."""
    out = {"prefill": paged_prefill_attention_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
                                                     md.max_query_len),
           "invariant": paged_attention_invariant_triton(q, kv, md.query_start_loc, md.seq_lens, md.block_tables,
                                                         SCALE, md.max_query_len)}
    if md.max_query_len == 1:
        for splits in (1, 3):
            out[f"decode-{splits}"] = paged_decode_attention_triton(q, kv, md.seq_lens, md.block_tables, SCALE,
                                                                    md.max_seq_len, splits)
    if q.device.type == "cpu":  # the torch paths are the CPU engine's (and CUDA's torch backend's)
        out["torch"] = paged_attention_torch(q, kv, md, SCALE)
        out["invariant-torch"] = paged_attention_invariant_torch(q, kv, md.token_req_idx, md.positions,
                                                                 md.block_tables, SCALE, md.max_seq_len)
    return out


def _assert_reads_fp8_exactly(dtype, cache_dtype, device, shape=(4, 4, 2, 32), cases=None):
    for q_lens, ctx in cases or (([1, 7, 20, 1], [0, 0, 37, 60]), ([1, 1, 1], [8, 99, 40])):
        q, kv8, md = _paged(dtype, cache_dtype, q_lens, ctx, device, shape=shape)
        widened = kv8.to(dtype)  # the same values in q's dtype (exact)
        got, want = _paths(q, kv8, md), _paths(q, widened, md)
        for name in want:
            assert got[name].dtype == dtype, name
            assert torch.equal(got[name], want[name]), (name, q_lens)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_reads_an_fp8_cache_as_its_values(dtype, cache_dtype):
    _assert_reads_fp8_exactly(dtype, cache_dtype, "cpu")


def test_gather_kv_reads_fp8_as_bytes():
    cache = (torch.randn(10, 2, 4) * 5).to(torch.float8_e4m3fn)
    slots = torch.tensor([[3, 0], [9, 3]])
    got = gather_kv(cache, slots, torch.bfloat16)
    assert got.shape == (2, 2, 2, 4) and got.dtype == torch.bfloat16
    assert torch.equal(got, cache.float()[slots].to(torch.bfloat16))


def test_a_mismatched_cache_dtype_is_an_error():
    q, kv8, md = _paged(torch.bfloat16, torch.float8_e4m3fn, [1], [4])
    with pytest.raises(ValueError, match="kv_cache of q's dtype or an fp8 format"):
        paged_prefill_attention_triton(q, kv8.to(torch.float16), md.query_start_loc, md.seq_lens, md.block_tables,
                                       SCALE, md.max_query_len)


# Compiled (not interpreted) in a fresh process for Hopper by bench/compile_sm90.py: the bf16 decode (both split
# modes) and prefill kernels over bf16, e4m3 and e5m2 caches, the fp8 write, alone and fused into the rope kernel
# (and that fused rope kernel over a bf16 cache, the engine's default path, and without a cache); the interpreter
# cannot catch a type the GPU compiler refuses (it did not catch one the fused rope kernel had). The aligned variants
# only (the ones the GPU runs on real shapes, and the ones a change broke in session 23): the unaligned ones double
# the time; `python bench/compile_sm90.py` builds both.
def test_fp8_variants_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not found in a cache
    script = Path(replayllm.__file__).parent / "bench" / "compile_sm90.py"
    done = subprocess.run([sys.executable, str(script), "--aligned-only"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_compiled_kernels_read_an_fp8_cache_as_its_values(dtype, cache_dtype):
    _assert_reads_fp8_exactly(dtype, cache_dtype, "cuda")
    # Qwen3-0.6B's heads (16 q over 8 kv of 128, block size 16): the tiles the engine runs (prefill 64-key tiles,
    # decode splits, the invariant 128-key tile) over a mixed step and a decode step of 40 rows. Session 24: the
    # compiled fp8 variants' dots used another operand layout than the 16-bit ones (kernels/paged_attention.py
    # `attention_tile.widen`), which the small case above showed for one of its twelve cases only.
    rng = torch.Generator().manual_seed(5)
    decode_ctx = torch.randint(1, 700, (40,), generator=rng).tolist()
    _assert_reads_fp8_exactly(dtype, cache_dtype, "cuda", shape=(16, 16, 8, 128),
                              cases=(([1] * 8 + [300, 77], [50] * 8 + [0, 200]), ([1] * 40, decode_ctx)))
    # and the compiled write is torch's clamp + cast, bit for bit
    g = torch.Generator().manual_seed(1)
    k, v = ((torch.randn(64, 2, 32, generator=g) * 300).to(dtype).cuda() for _ in range(2))
    slots = torch.randperm(80, generator=g)[:64].cuda()
    cache = torch.zeros(2, 20, 4, 2, 32, dtype=cache_dtype, device="cuda")
    ref = cache.clone()
    write_kv_cache_triton(cache, k, v, slots)
    write_kv_cache_torch(ref, k, v, slots)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
