"""The KV-cache write fused into the q/k norm + rope kernel (kernels/rotary.py KVWrite, the engine's fused path):
bit for bit the rope kernel's q and the cache that the separate write kernel stores from its k, for every model
dtype and cache dtype (the model's, fp8 e4m3/e5m2), with and without Qwen3's q/k norm, strided views of the
projection and padded rows on the sink slot. Under the interpreter here; compiled on CUDA in the `gpu` test."""

from __future__ import annotations

import pytest
import torch

from replayllm.kernels.kv_cache_write import write_kv_cache_triton
from replayllm.kernels.rotary import KVWrite, qk_norm_rope_triton

HQ, HKV, D, BLOCK, T = 4, 2, 32, 4, 11


def _case(dtype: torch.dtype, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (HQ + 2 * HKV) * D, generator=g) * 3).to(dtype).to(device)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))  # strided views
    positions = torch.randint(0, 64, (T,), generator=g).to(device)
    freqs = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D))
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(dtype).to(device) for _ in range(2))
    num_blocks = 8
    slots = torch.randperm((num_blocks - 1) * BLOCK, generator=g)[:T]
    slots[-3:] = (num_blocks - 1) * BLOCK  # padded CUDA-graph rows all write the sink slot ...
    qkv.view(T, -1)[-3:] = qkv.view(T, -1)[-3]  # ... with equal values, so its content is defined
    positions[-3:] = positions[-3]
    return q, k, v, positions.to(device), cos, sin, qw, kw, slots.to(device), num_blocks


def _assert_fused_equals_separate(dtype, cache_dtype, norm, device):
    q, k, v, positions, cos, sin, qw, kw, slots, num_blocks = _case(dtype, device)
    weights = (qw, kw) if norm else (None, None)
    shape = (2, num_blocks, BLOCK, HKV, D)
    fused_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    separate_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    q_fused, k_none = qk_norm_rope_triton(positions, q, k, cos, sin, *weights, 1e-6,
                                          kv_write=KVWrite(fused_cache, v, slots))
    q_sep, k_sep = qk_norm_rope_triton(positions, q, k, cos, sin, *weights, 1e-6)
    write_kv_cache_triton(separate_cache, k_sep.view(T, HKV, D), v, slots)
    assert k_none is None
    assert torch.equal(q_fused, q_sep)
    assert torch.equal(fused_cache.view(torch.uint8), separate_cache.view(torch.uint8))
    assert int((fused_cache.float() != 0).sum()) > 0.9 * 2 * (T - 2) * HKV * D  # the rows were written


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "rope-only"])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.bfloat16, torch.float8_e4m3fn),
                                                (torch.float32, torch.float8_e5m2)], ids=str)
def test_fused_write_equals_the_separate_write(dtype, cache_dtype, norm):
    _assert_fused_equals_separate(dtype, cache_dtype, norm, "cpu")


def test_fused_write_checks_its_cache():
    q, k, v, positions, cos, sin, qw, kw, slots, num_blocks = _case(torch.float32, "cpu")
    cache = torch.zeros(2, num_blocks, BLOCK, HKV, D)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_triton(positions, q, k, cos, sin, kv_write=KVWrite(cache, v, slots.int()))
    with pytest.raises(ValueError, match="v must be"):
        qk_norm_rope_triton(positions, q, k, cos, sin, kv_write=KVWrite(cache, v[:, :1], slots))
    with pytest.raises(ValueError, match="contiguous"):
        qk_norm_rope_triton(positions, q, k, cos, sin, kv_write=KVWrite(cache.transpose(1, 2), v, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float8_e4m3fn),
                                                (torch.bfloat16, torch.float8_e5m2)], ids=str)
def test_compiled_fused_write_equals_the_separate_write(dtype, cache_dtype):
    for norm in (True, False):
        _assert_fused_equals_separate(dtype, cache_dtype, norm, "cuda")
