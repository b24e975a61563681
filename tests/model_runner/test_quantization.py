"""Load-time quantization (int8 weight-only, fp8 e4m3 weights + per-token activations): the quantizers against
float, the quantized linears against their float and reference forms, quantize_model's reach, and whole engines
replaying one fixed trace set under fp32 / int8 / fp8 (same tokens; |Δlogprob| non-zero and under a bound)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_reference import VOCAB, load_hf, teacher_forced
from helpers.tolerances import LOGPROB_TOL, rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.config import QUANTIZATION_METHODS, ModelConfig
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.models.layers import Embedding, Linear
from replayllm.model_runner_v2.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    fp8_matmul_reference,
    quantize_fp8_per_row,
)
from replayllm.model_runner_v2.quantization.int8 import Int8Linear, quantize_int8_per_row
from replayllm.model_runner_v2.quantization.quantize import QUANTIZED_LINEARS, quantize_model

CPU = torch.device("cpu")
# |Δlogprob| vs the fp32 engine over the fixed trace set below (`replays`), on the tiny fp32 models of
# hf_reference (initializer_range=0.5: logits of magnitude ~20 and a chaotic residual stream, which magnify every
# relative error: an independent fake-quantized transformers model drifts from fp32 just as far). Measured,
# over the three architectures (docs/config_axes.md has the per-model table):
#   int8: mean 0.074-0.179, max 0.45-2.26        fp8: mean 0.37-1.06, max 2.15-7.86
# Bounds are ~2x the worst measurement. That the numbers are the *right* ones (not merely bounded) is checked
# separately against transformers with fake-quantized weights/activations (test_engine_matches_fake_quantized_hf).
BOUNDS = {"int8": {"mean": 0.4, "max": 4.5}, "fp8": {"mean": 2.0, "max": 12.0}}


def _rows_with_spread(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] fp32 with row magnitudes spread over 6 decades, one all-zero row and one outlier per row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 2, n)[:, None]
    w[torch.arange(n), torch.randint(0, k, (n,), generator=g)] *= 8  # an outlier sets each row's scale
    w[n // 2] = 0
    return w


# -- the quantizers --------------------------------------------------------------------------------------------
def test_int8_quantizer_scales_range_and_error_bound():
    w = _rows_with_spread(48, 96)
    q, scale = quantize_int8_per_row(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    nonzero = w.abs().amax(1) > 0
    assert (q.abs().amax(1)[nonzero] == 127).all()  # each row's largest weight uses the full range
    assert torch.equal(q[48 // 2], torch.zeros(96, dtype=torch.int8))  # the zero row stays zero, finite scale
    err = (q.float() * scale[:, None] - w).abs()  # per element, per output channel
    # Half a step, plus the fp32 rounding of q * scale and of w / scale (|q| <= 127 steps).
    assert (err <= scale[:, None] * (0.5 + rounding_tol(127, steps=2))).all()
    assert torch.equal(scale[nonzero], w.abs().amax(1)[nonzero] / 127)  # the documented formula, bit for bit


def test_int8_quantizer_round_trip_is_stable():
    w = _rows_with_spread(32, 64, seed=1)
    q, scale = quantize_int8_per_row(w)
    q2, scale2 = quantize_int8_per_row(q.float() * scale[:, None])  # a dequantised weight is a fixed point
    assert torch.equal(q2, q)
    # amax(q * scale) / 127 = scale up to two roundings (the multiply, the divide).
    torch.testing.assert_close(scale2, scale, rtol=rounding_tol(1, steps=2), atol=0)


def test_fp8_quantizer_scales_range_and_error_bound():
    w = _rows_with_spread(48, 96, seed=2)
    q, scale = quantize_fp8_per_row(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (48, 1)
    deq = q.float() * scale
    assert torch.isfinite(deq).all()
    nonzero = w.abs().amax(1) > 0
    assert (q.float().abs().amax(1)[nonzero] == FP8_MAX).all()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 -> absolute error
    # <= 2^-10 (in units of the row scale). Slack for the fp32 division.
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-5)
    assert ((deq - w).abs() <= bound).all()
    q2, scale2 = quantize_fp8_per_row(deq)
    # A fixed point up to the roundings of the new scale (see the int8 round trip) and of q2 * scale2.
    torch.testing.assert_close(q2.float() * scale2, deq, rtol=rounding_tol(1, steps=3), atol=0)


def test_fp8_activation_scales_are_per_token():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 10.0, 0.0, 300.0])[:, None]
    q, scale = quantize_fp8_per_row(x)
    assert scale.shape == (5, 1)
    assert torch.equal(scale[[0, 1, 2, 4], 0], x.abs().amax(1)[[0, 1, 2, 4]] / FP8_MAX)  # the formula, exactly
    assert torch.equal(q[3].float(), torch.zeros(32))  # a zero token: q = 0, not NaN


# -- the quantized linears ---------------------------------------------------------------------------------------
def _linear(n: int, k: int, bias: bool, seed: int) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * torch.linspace(0.01, 1.0, n)[:, None])
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantised_weight_and_float_bound(bias):
    lin = _linear(40, 64, bias, seed=3)
    x = torch.randn(2, 7, 64)  # leading dims are kept
    qlin = Int8Linear.from_linear(lin)
    y = qlin(x)
    assert y.shape == (2, 7, 40) and y.dtype == x.dtype
    deq = qlin.qweight.float() * qlin.scale[:, None]
    ref = torch.nn.functional.linear(x, deq, lin.bias)
    # (x @ q^T) * scale vs x @ (q * scale)^T: length-64 dots and the scale multiply in another order.
    torch.testing.assert_close(y, ref, rtol=0, atol=rounding_tol(ref, terms=64, steps=2))
    # Per output channel: every weight is off by <= scale_n / 2, so |Δy_n| <= scale_n / 2 * sum_k |x_k|
    # (plus both sides' fp32 rounding).
    bound = x.abs().sum(-1, keepdim=True) * qlin.scale / 2 + rounding_tol(ref, terms=64, steps=2)
    assert ((y - lin(x)).abs() <= bound).all()
    assert (y - lin(x)).abs().max() > 0


def test_int8_linear_in_bf16_and_fp16():
    x = torch.randn(5, 48)
    for dtype in (torch.bfloat16, torch.float16):
        lin = _linear(32, 48, True, seed=4).to(dtype)
        qlin = Int8Linear.from_linear(lin)
        y = qlin(x.to(dtype))
        assert y.dtype == dtype and qlin.qweight.dtype == torch.int8
        # Same q and scales as quantizing the (already rounded) weights in fp32: only the arithmetic differs.
        ref_q = Int8Linear.from_linear(_linear(32, 48, True, seed=4).to(dtype).float())
        assert torch.equal(ref_q.qweight, qlin.qweight)
        ref = ref_q(x.to(dtype).float())
        # Two half-precision roundings (x @ q^T, then * scale): <= 2^-7 relative (bf16); rtol 2e-2 leaves 2.5x,
        # atol (1% of the largest output) covers entries near 0 (unchanged).
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=1e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_reference_gemm_and_close_to_float(bias):
    lin = _linear(48, 64, bias, seed=5)
    x = torch.randn(9, 64) * torch.logspace(-2, 2, 9)[:, None]  # tokens of very different scales
    qlin = Fp8Linear.from_linear(lin)
    assert not qlin.use_scaled_mm  # CPU: the reference path
    assert qlin.qweight.dtype == FP8_DTYPE and qlin.scale.shape == (1, 48)
    y = qlin(x)
    # Written out by hand: dequantise both operands, matmul in fp32.
    xq, xs = quantize_fp8_per_row(x)
    want = (xq.float() * xs) @ (qlin.qweight.float() * qlin.scale.t()).t()
    if bias:
        want = want + lin.bias
    scale_of_terms = x.abs() @ lin.weight.abs().t()  # [T, N]: fp32 summation error is relative to this
    rel = rounding_tol(1, terms=64)  # length-64 dots in another order, relative to the terms (and the bias add)
    assert ((y - want).abs() <= rel * (scale_of_terms + want.abs())).all()
    # Against float, per token and channel: both operands carry <= 2^-4 relative error (+ subnormal terms).
    yf = lin(x)
    bound = scale_of_terms * (2**-3 + 2**-8) + 1e-3 * (xs * qlin.scale)
    assert ((y - yf).abs() <= bound + rel * (scale_of_terms + yf.abs())).all()
    assert (y - yf).abs().max() > 0


def test_fp8_reference_output_dtype():
    lin = _linear(16, 32, False, seed=6)
    qlin = Fp8Linear.from_linear(lin)
    xq, xs = quantize_fp8_per_row(torch.randn(3, 32))
    y = fp8_matmul_reference(xq, xs, qlin.qweight, qlin.scale, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 16)


# -- quantize_model ----------------------------------------------------------------------------------------------
def test_quantization_methods_agree_with_config():
    assert set(QUANTIZED_LINEARS) == {m for m in QUANTIZATION_METHODS if m is not None}


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_quantize_model_replaces_layer_linears_only(tiny_models, arch, method):
    mc = ModelConfig.from_pretrained(tiny_models[arch])
    model = load_model(mc, CPU, quantization=method)
    cls = QUANTIZED_LINEARS[method]
    for layer in model.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(mod) is cls
    assert not any(isinstance(m, Linear) for m in model.model.layers.modules())
    # Embedding and lm_head stay float (a tied head is still the embedding table itself).
    assert type(model.model.embed_tokens) is Embedding and type(model.lm_head) is Linear
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (arch == "qwen3")
    float_model = load_model(mc, CPU)
    assert torch.equal(model.lm_head.weight, float_model.lm_head.weight)
    if arch == "qwen2":  # qkv bias survives quantization unchanged
        assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias,
                           float_model.model.layers[0].self_attn.qkv_proj.bias)


def test_quantize_model_counts_and_rejects_unknown(tiny_models):
    mc = ModelConfig.from_pretrained(tiny_models["llama"])
    model = load_model(mc, CPU, load_format="dummy")
    assert quantize_model(model, "int8") == 4 * mc.num_layers
    with pytest.raises(ValueError, match="int8"):
        quantize_model(load_model(mc, CPU, load_format="dummy"), "int4")


def test_bad_quantization_values_are_value_errors(tiny_models):
    for bad in ("awq", "INT8", "none", "", 8):
        with pytest.raises(ValueError, match="quantization"):
            LLM(tiny_models["qwen3"], device="cpu", max_model_len=64, skip_tokenizer_init=True, quantization=bad)


def test_fp8_rejected_on_gpus_before_ada(tiny_models, monkeypatch):
    # No GPU here: pretend there is an A100 (capability 8.0); the check runs before anything touches CUDA.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="8.9"):
        LLM(tiny_models["qwen3"], device="cuda", max_model_len=64, skip_tokenizer_init=True, quantization="fp8")


# -- engines: one fixed trace set under fp32 / int8 / fp8 --------------------------------------------------------
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 17, 33, 64)]
TRACE_LEN = 16
RANDOM_TRACES = [[_rng.randrange(3, VOCAB) for _ in range(TRACE_LEN)] for _ in PROMPTS]


def _engine(path: str, quantization: str | None) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
               enable_trace_replay=True, quantization=quantization, kv_cache_memory_bytes=8 << 20)


def _run(llm: LLM, params: list[SamplingParams]) -> tuple[list[list[int]], list[list[float]]]:
    """PROMPTS twice (one batch of 8), one SamplingParams each -> (emitted tokens, their logprobs) per request."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params, use_tqdm=False)
    comps = [o.outputs[0] for o in outs]
    return [c.token_ids for c in comps], [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in comps]


@pytest.fixture(scope="module")
def replays(tiny_models):
    """arch -> {"traces": the fixed trace set, None / "int8" / "fp8": (emitted tokens, logprobs)}.

    The trace set is, per prompt, the fp32 engine's greedy continuation (logprobs near 0) and a random token
    sequence (logprobs ~ -20): both regimes. The fp32 run produces the greedy rows itself (same batch shapes as
    the replays: 8 requests, same prompts, same lengths), the quantized engines replay all 8 traces."""
    greedy = SamplingParams(temperature=0, max_tokens=TRACE_LEN, ignore_eos=True, logprobs=0)
    results = {}
    for arch, path in tiny_models.items():
        tokens, lps = _run(_engine(path, None), [greedy] * len(PROMPTS)
                           + [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in RANDOM_TRACES])
        results[arch] = {"traces": tokens, None: (tokens, lps)}
        for method in ("int8", "fp8"):
            results[arch][method] = _run(_engine(path, method),
                                         [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in tokens])
    return results


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_engine_logprob_deltas_vs_fp32(replays, arch, method):
    r = replays[arch]
    assert r["traces"][len(PROMPTS):] == RANDOM_TRACES
    assert r[method][0] == r["traces"]  # trace replay emits the same tokens under every config
    base, quant = torch.tensor(r[None][1]), torch.tensor(r[method][1])
    assert torch.isfinite(quant).all()
    d = (quant - base).abs()
    print(f"\n[quantization] {arch} {method}: mean |dlogprob| {d.mean():.4f}, max {d.max():.4f} "
          f"(greedy traces: mean {d[:len(PROMPTS)].mean():.4f}, max {d[:len(PROMPTS)].max():.4f}) over {d.numel()}")
    assert d.max() > 0 and d.mean() > 0  # really a different numerics path
    assert d.mean() <= BOUNDS[method]["mean"] and d.max() <= BOUNDS[method]["max"]


def test_fp8_is_coarser_than_int8(replays):
    # Per-channel int8 keeps ~7 bits of every weight; e4m3 keeps 3 mantissa bits of weights and activations.
    for r in replays.values():
        base = torch.tensor(r[None][1])
        assert (torch.tensor(r["fp8"][1]) - base).abs().mean() > (torch.tensor(r["int8"][1]) - base).abs().mean()


def test_engine_runs_the_quantized_model(tiny_models):
    llm = _engine(tiny_models["qwen2"], "int8")
    model = llm.llm_engine.runner.model
    assert type(model.model.layers[0].mlp.down_proj) is Int8Linear and type(model.lm_head) is Linear
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8


def _fake_quantize_hf(model, method: str):
    """transformers model with every decoder-layer nn.Linear fake-quantized, written independently of
    model_runner_v2/quantization: weights replaced by their dequantised values; for fp8 a pre-hook also rounds each
    input token to e4m3 with its own scale."""
    with torch.no_grad():
        for mod in model.model.layers.modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            w = mod.weight
            if method == "int8":
                s = w.abs().amax(1, keepdim=True) / 127
                w.copy_(torch.round(w / s).clamp(-127, 127) * s)
            else:
                s = w.abs().amax(1, keepdim=True) / 448
                w.copy_((w / s).to(torch.float8_e4m3fn).float() * s)

                def per_token_fp8(_module, args):
                    x = args[0]
                    s = x.abs().amax(-1, keepdim=True) / 448
                    return ((x / s).to(torch.float8_e4m3fn).float() * s,)

                mod.register_forward_pre_hook(per_token_fp8)
    return model


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_engine_matches_fake_quantized_hf(tiny_models, arch, method):
    # Measured: max |Δ| 5e-6 (fp8) to 2e-5 (int8), fp32 summation order (tolerances.LOGPROB_TOL). fp8 allows more
    # (1e-3, unchanged): an activation within one fp32 ulp of an e4m3 rounding boundary may round the other way
    # on another CPU.
    prompt, trace = PROMPTS[2], RANDOM_TRACES[2]
    llm = _engine(tiny_models[arch], method)
    comp = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=0),
                        use_tqdm=False)[0].outputs[0]
    lp, _ = teacher_forced(_fake_quantize_hf(load_hf(tiny_models[arch]), method), prompt, trace)
    d = max(abs(comp.logprobs[i][t].logprob - float(lp[i, t])) for i, t in enumerate(trace))
    assert d <= (LOGPROB_TOL if method == "int8" else 1e-3)
