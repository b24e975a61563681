"""Compiled fused decoder-layer kernels vs their torch references on CUDA (marker `gpu`, skipped on CPU; run on
the lent H200 by `bash bench/gpu_check.sh`): accuracy in fp32/bf16 and CUDA-event timings at a decode-shaped
batch (Qwen3-0.6B-like: T=256, hidden 1024, 16 q / 8 kv heads, head_dim 128, intermediate 3072); tiny engines
with the fused path (CUDA graphs included) against the torch path."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from replayllm.entrypoints.bench.workload import cuda_ms
from replayllm.kernels import dispatch
from replayllm.kernels.activation import gelu_tanh_and_mul_torch, silu_and_mul_torch, silu_and_mul_triton
from replayllm.kernels.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton
from replayllm.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from replayllm.kernels.rotary import qk_norm_rope_torch, qk_norm_rope_triton

pytestmark = pytest.mark.gpu

T, HIDDEN, HQ, HKV, D, INTER, BLOCK, MAX_POS = 256, 1024, 16, 8, 128, 3072, 16, 4096


def _cases(dtype: torch.dtype):
    """name -> (fused fn, reference fn, outputs getter) on one decode-shaped batch in `dtype`."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    x, res, w = rnd(T, HIDDEN, scale=3.0), rnd(T, HIDDEN), rnd(HIDDEN)
    qkv = rnd(T, (HQ + 2 * HKV) * D, scale=2.0)
    q = qkv[:, : HQ * D].view(T, HQ, D)
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(T, HKV, D)
    v = qkv[:, (HQ + HKV) * D :].view(T, HKV, D)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(MAX_POS, device="cuda").float(), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, MAX_POS, (T,), generator=g, device="cuda")
    qw, kw = rnd(D), rnd(D)
    gate_up = rnd(T, 2 * INTER, scale=3.0)
    num_blocks = T // BLOCK * 4 + 1
    slots = torch.randperm((num_blocks - 1) * BLOCK, generator=g, device="cuda")[:T]
    slots[-8:] = (num_blocks - 1) * BLOCK  # padded rows write the sink slot
    v[-8:] = 0
    k_pad = k.clone()
    k_pad[-8:] = 0
    caches = [torch.zeros(2, num_blocks, BLOCK, HKV, D, dtype=dtype, device="cuda") for _ in range(2)]

    def kv_fused():
        write_kv_cache_triton(caches[0], k_pad, v, slots)
        return caches[0]

    def kv_ref():
        write_kv_cache_torch(caches[1], k_pad, v, slots)
        return caches[1]

    return {
        "rms_norm": (partial(rms_norm_triton, x, w, 1e-6), partial(rms_norm_torch, x, w, 1e-6)),
        "add_rms_norm": (partial(rms_norm_triton, x, w, 1e-6, res), partial(rms_norm_torch, x, w, 1e-6, res)),
        "rope": (partial(qk_norm_rope_triton, positions, q, k, cos, sin),
                 partial(qk_norm_rope_torch, positions, q, k, cos, sin)),
        "qk_norm_rope": (partial(qk_norm_rope_triton, positions, q, k, cos, sin, qw, kw, 1e-6),
                         partial(qk_norm_rope_torch, positions, q, k, cos, sin, qw, kw, 1e-6)),
        "silu_and_mul": (partial(silu_and_mul_triton, gate_up), partial(silu_and_mul_torch, gate_up)),
        # Gemma's: (1 + weight) in fp32, and the tanh GELU (the kernel's g * sigmoid(2y) against torch's tanh)
        "add_rms_norm_unit_offset": (partial(rms_norm_triton, x, w, 1e-6, res, unit_offset=True),
                                     partial(rms_norm_torch, x, w, 1e-6, res, unit_offset=True)),
        "gelu_tanh_and_mul": (partial(silu_and_mul_triton, gate_up, gelu_tanh=True),
                              partial(gelu_tanh_and_mul_torch, gate_up)),
        "write_kv_cache": (kv_fused, kv_ref),
    }


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_kernels_vs_torch_on_cuda(dtype):
    rows = []
    for name, (fused, ref) in _cases(dtype).items():
        worst = 0.0
        for got, want in zip(_flat(fused()), _flat(ref())):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert not got.isnan().any()
            diff = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item()
            worst = max(worst, diff / max(scale, 1e-30))
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * max(scale, 1.0))
            else:
                # rsqrt/exp approximations on the GPU move an element on a rounding boundary by one bf16 ulp
                # per rounding; at most a few ulps of the output's magnitude.
                assert diff <= 4 * torch.finfo(dtype).eps * scale, (name, diff, scale)
        rows.append((name, worst, cuda_ms(fused, reps=50), cuda_ms(ref, reps=50)))
    print(f"\n[fused kernels cuda] {dtype}, T={T} hidden={HIDDEN} Hq={HQ} Hkv={HKV} D={D} I={INTER}")
    print("| kernel | max rel diff | fused ms | torch ms | speedup |\n| --- | --- | --- | --- | --- |")
    for name, worst, t_fused, t_ref in rows:
        print(f"| {name} | {worst:.1e} | {t_fused:.4f} | {t_ref:.4f} | {t_ref / t_fused:.1f}x |")
    total_f, total_r = sum(r[2] for r in rows), sum(r[3] for r in rows)
    print(f"| all | | {total_f:.4f} | {total_r:.4f} | {total_r / total_f:.1f}x |")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_fused_vs_torch_on_cuda(tiny_models, arch, dtype, monkeypatch):
    # The default CUDA engine (CUDA graphs, Triton attention) with the fused kernels, then with ENABLED off.
    from replayllm import LLM, SamplingParams

    prompts = [[5, 17, 300, 42, 8, 99, 100], [9, 3, 77], [11] * 20]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(dispatch, "ENABLED", fused)
        llm = LLM(tiny_models[arch], device="cuda", dtype=dtype, max_model_len=128, block_size=16,
                  skip_tokenizer_init=True)
        runs[fused] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
        del llm
    worst = 0.0
    for a, b in zip(runs[True], runs[False]):
        if dtype == "float32":
            assert a.token_ids == b.token_ids
        for la, lb, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            if ta != tb:
                break  # a bf16 near-tie flipped: later steps continue different texts
            worst = max(worst, abs(la[ta].logprob - lb[tb].logprob))
    print(f"\n[fused engine cuda] {arch} {dtype}: max |logprob fused - torch| = {worst:.2e}")
    assert worst <= (1e-4 if dtype == "float32" else 0.1), worst
