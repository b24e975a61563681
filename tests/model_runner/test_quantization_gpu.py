"""Quantization on CUDA (marker `gpu`, skipped on CPU; run on the lent H200 by `bash bench/gpu_check.sh`): the fp8
`torch._scaled_mm` path against the reference GEMM on Qwen3-0.6B linear shapes, and fp8 / int8 engines against
bf16 on a Qwen3-0.6B-shaped dummy model (numbers printed, bounds asserted)."""

from __future__ import annotations

import pytest
import torch

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.models.layers import Linear
from replayllm.model_runner_v2.quantization.fp8 import (
    Fp8Linear,
    fp8_matmul_reference,
    quantize_fp8_per_row,
)
from replayllm.model_runner_v2.quantization.int8 import Int8Linear

pytestmark = pytest.mark.gpu
QWEN3_0_6B_LINEARS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # [N, K]: qkv, o, gate_up, down
# fp8 / int8 vs bf16 on the dummy 0.6B model (weights ~U(-1e-3, 1e-3): logits ~0.02, logprobs ~ -11.93).
# Measured on the H200 (this test): fp8 mean 1.12e-3, max 3.90e-3; int8 mean 1.98e-4, max 1.95e-3.
DUMMY_BOUNDS = {"fp8": {"mean": 0.01, "max": 0.05}, "int8": {"mean": 0.002, "max": 0.01}}


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Counts torch._scaled_mm calls (Fp8Linear looks it up at call time)."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def _linear(n: int, k: int, dtype: torch.dtype, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
    return lin.to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("shape", QWEN3_0_6B_LINEARS)
def test_scaled_mm_matches_reference_gemm(scaled_mm_calls, shape, num_tokens):
    n, k = shape
    qlin = Fp8Linear.from_linear(_linear(n, k, torch.bfloat16, seed=n + k))
    assert qlin.use_scaled_mm
    x = torch.randn(num_tokens, k, device="cuda", dtype=torch.bfloat16)
    y = qlin(x)
    assert len(scaled_mm_calls) == 1 and y.dtype == torch.bfloat16 and y.shape == (num_tokens, n)
    # The same quantized operands through the plain-torch reference, on the CPU.
    xq, xs = quantize_fp8_per_row(x)
    ref = fp8_matmul_reference(xq.cpu(), xs.cpu(), qlin.qweight.cpu(), qlin.scale.cpu(), torch.bfloat16)
    diff = (y.cpu().float() - ref.float()).abs()
    # Both are fp32 accumulations rounded once to bf16: at most ~one bf16 ulp (2^-8 relative) apart.
    assert (diff <= ref.float().abs() * 2**-7 + 1e-3 * float(ref.float().abs().max())).all()
    print(f"\n[fp8 _scaled_mm vs reference] N={n} K={k} T={num_tokens}: max |dy| {diff.max():.3e} "
          f"(|y| max {ref.float().abs().max():.3e})")


def test_scaled_mm_fp32_model_and_unaligned_fallback(scaled_mm_calls):
    qlin = Fp8Linear.from_linear(_linear(256, 512, torch.float32, seed=1))
    x = torch.randn(9, 512, device="cuda")
    y = qlin(x)
    assert y.dtype == torch.float32 and len(scaled_mm_calls) == 1  # bf16 out of the GEMM, upcast
    xq, xs = quantize_fp8_per_row(x)
    ref = fp8_matmul_reference(xq, xs, qlin.qweight, qlin.scale, torch.float32)
    torch.testing.assert_close(y, ref, rtol=2**-7, atol=1e-3)
    odd = Fp8Linear.from_linear(_linear(40, 24, torch.bfloat16, seed=2))  # not multiples of 16: reference path
    assert not odd.use_scaled_mm
    assert odd(torch.randn(3, 24, device="cuda", dtype=torch.bfloat16)).shape == (3, 40)
    assert len(scaled_mm_calls) == 1


def test_dummy_qwen3_0_6b_quantized_vs_bf16(scaled_mm_calls):
    from replayllm.entrypoints.bench.workload import dummy_trace_case

    path, prompts, random_traces = dummy_trace_case(0, (1, 16, 64, 200, 333, 512), low=0, high=151_000)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)

    def engine(quantization):
        # attention_backend="torch" on both sides: the comparison isolates the quantization axis.
        return LLM(path, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                   attention_backend="torch", max_model_len=1024, enable_trace_replay=True,
                   quantization=quantization, kv_cache_memory_bytes=1 << 30)

    def run(llm, params):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], params, use_tqdm=False)
        comps = [o.outputs[0] for o in outs]
        return [c.token_ids for c in comps], torch.tensor(
            [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in comps])

    base = engine(None)
    traces, base_lp = run(base, [greedy] * len(prompts)
                          + [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in random_traces])
    del base
    torch.cuda.empty_cache()
    for method, cls in (("fp8", Fp8Linear), ("int8", Int8Linear)):
        llm = engine(method)
        layer = llm.llm_engine.runner.model.model.layers[0]
        assert type(layer.self_attn.qkv_proj) is cls and type(llm.llm_engine.runner.model.lm_head) is Linear
        calls_before = len(scaled_mm_calls)
        tokens, lp = run(llm, [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces])
        assert tokens == traces
        d = (lp - base_lp).abs()
        print(f"\n[quantization 0.6B dummy] {method} vs bf16: mean |dlogprob| {d.mean():.3e}, max {d.max():.3e} "
              f"over {d.numel()} tokens; _scaled_mm calls {len(scaled_mm_calls) - calls_before}")
        if method == "fp8":
            assert all(m.use_scaled_mm for m in llm.llm_engine.runner.model.modules() if isinstance(m, Fp8Linear))
            assert len(scaled_mm_calls) - calls_before > 0
        assert d.max() > 0 and d.mean() <= DUMMY_BOUNDS[method]["mean"] and d.max() <= DUMMY_BOUNDS[method]["max"]
        del llm
        torch.cuda.empty_cache()
