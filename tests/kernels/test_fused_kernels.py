"""Fused decoder-layer kernels (RMSNorm + residual, q/k norm + rotary, SiluAndMul, KV-cache write) against their
plain-torch references under the Triton interpreter; the references against the pre-fusion torch code of
layers.py/decoder.py/attention.py (bit for bit); the engine with the fused path forced on CPU against the torch
path. The compiled kernels on CUDA: tests/kernels/test_fused_kernels_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import LOGPROB_TOL, rounding_tol

from replayllm.kernels import dispatch
from replayllm.kernels.activation import gelu_tanh_and_mul_invariant_torch, silu_and_mul_torch, silu_and_mul_triton
from replayllm.kernels.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton
from replayllm.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from replayllm.kernels.rotary import qk_norm_rope_torch, qk_norm_rope_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the last place of b's dtype at b's magnitude (0 = bit-exact)."""
    eps = torch.finfo(b.dtype).eps
    a, b = a.double(), b.double()
    scale = torch.exp2(torch.floor(torch.log2(b.abs().clamp(min=1e-30)))) * eps
    return float(((a - b).abs() / scale).max()) if a.numel() else 0.0


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN-filled float tensors while active: a kernel that skips an element shows it."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)
    yield
    monkeypatch.setattr(torch, "empty", real_empty)


# -- RMSNorm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 100])
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("order", ["llama", "olmo2", "gemma"])
def test_rms_norm_matches_reference(dtype, hidden, num_tokens, with_residual, order, poisoned_empty):
    """The three orders: Llama's (cast, then the weight), OLMo2's (the weight in fp32, one cast) and Gemma's
    ((1 + weight) in fp32, one cast)."""
    x = _rand(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    w = _rand(hidden, dtype=dtype, seed=2)
    # A strided residual (every other column block of a wider buffer): row strides are honoured.
    residual = _rand(num_tokens, 2 * hidden, dtype=dtype, seed=3)[:, :hidden] if with_residual else None
    kinds = dict(weight_in_fp32=order != "llama", unit_offset=order == "gemma")
    got = rms_norm_triton(x, w, 1e-6, residual, **kinds)
    ref = rms_norm_torch(x, w, 1e-6, residual, **kinds)
    if with_residual:
        assert torch.equal(got[1], ref[1])  # the add: one rounding, bit-exact
        got, ref = got[0], ref[0]
    assert not got.isnan().any()
    _assert_norm_close(got, ref)


def _assert_norm_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32: the mean of squares is summed in another order than torch's (a length-hidden reduction), then
    # scaled elementwise: a relative bound per element.
    # bf16/fp16: the same fp32 difference can flip the rounding of an element that sits within an fp32 ulp
    # of a rounding boundary -> at most 1 ulp of the half dtype per rounding (two roundings: normed, * weight).
    if got.dtype == torch.float32:
        tol = rounding_tol(1, terms=ref.shape[-1], steps=2)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    else:
        assert _ulps(got, ref) <= 2, _ulps(got, ref)
        assert (got != ref).float().mean() < 0.05  # nearly all elements bit-exact


def test_rms_norm_weight_in_fp32_is_olmo2s_order():
    """weight_in_fp32: (weight * normed32).to(dtype), one rounding (HF's Olmo2RMSNorm); the default rounds the
    normed row first, then the product (HF's Llama). In bf16 the two differ somewhere."""
    import transformers.models.olmo2.modeling_olmo2 as olmo2

    x, w = _rand(7, 64, dtype=torch.bfloat16, seed=4, scale=3.0), _rand(64, dtype=torch.bfloat16, seed=5)
    hf = olmo2.Olmo2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(rms_norm_torch(x, w, 1e-6, weight_in_fp32=True), hf(x))
    assert not torch.equal(rms_norm_torch(x, w, 1e-6), hf(x))


def test_rms_norm_3d_input_and_bad_inputs():
    x = _rand(3, 4, 32, seed=4)
    w = _rand(32, seed=5)
    _assert_norm_close(rms_norm_triton(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, w.double(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, _rand(31), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, w, 1e-5, x[:2])
    with pytest.raises(ValueError, match="stride"):
        rms_norm_triton(x.transpose(1, 2), _rand(4), 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        rms_norm_triton(x.double(), w.double(), 1e-5)


# -- q/k norm + rotary ---------------------------------------------------------------------------------------


def _rope_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, seed=0):
    """q/k as strided views of one qkv projection output [T, (Hq + 2Hkv) * D], like the decoder's."""
    qkv = _rand(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                   head_dim)
    max_pos = 300
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    g = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)  # not contiguous, repeats allowed
    weights = (_rand(head_dim, dtype=dtype, seed=seed + 2), _rand(head_dim, dtype=dtype, seed=seed + 3)) if norm \
        else (None, None)
    return positions, q, k, freqs.cos(), freqs.sin(), *weights


ROPE_SHAPES = [(1, 4, 2, 32), (5, 6, 2, 24), (3, 4, 4, 16), (4, 8, 1, 64)]  # (T, Hq, Hkv, D): GQA 2/3/1/8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "t{}-hq{}-hkv{}-d{}".format(*s))
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qknorm-rope"])
def test_qk_norm_rope_matches_reference(dtype, shape, norm, poisoned_empty):
    args = _rope_case(*shape, dtype=dtype, norm=norm)
    q, k = qk_norm_rope_triton(*args, eps=1e-6)
    q_ref, k_ref = qk_norm_rope_torch(*args, eps=1e-6)
    assert q.shape == q_ref.shape and k.shape == k_ref.shape and q.is_contiguous() and k.is_contiguous()
    assert not q.isnan().any() and not k.isnan().any()
    if not norm:
        # No reduction: the same fp32 operations and roundings in the same order -> bit-exact in every dtype.
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    elif dtype == torch.float32:
        # The per-head mean of squares in another order (length head_dim), then the norm and the rotation.
        tol = rounding_tol(1, terms=shape[3], steps=2)
        torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
        torch.testing.assert_close(k, k_ref, rtol=tol, atol=tol)
    else:
        # The per-head mean differs in summation order (fp32 ulps); a normed element on a rounding boundary
        # can move by one ulp, and the rotation's three roundings carry it: a few ulps of the half dtype.
        for got, ref in ((q, q_ref), (k, k_ref)):
            assert (got.float() - ref.float()).abs().max() <= 4 * torch.finfo(dtype).eps * ref.abs().max().float()
            assert (got != ref).float().mean() < 0.05


def test_qk_norm_rope_rejects_bad_inputs():
    positions, q, k, cos, sin, qw, kw = _rope_case(2, 4, 2, 32, torch.float32, norm=True)
    with pytest.raises(ValueError, match="together"):
        qk_norm_rope_triton(positions, q, k, cos, sin, qw, None)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rope_triton(positions.int(), q, k, cos, sin)
    with pytest.raises(ValueError, match="cos_cache"):
        qk_norm_rope_triton(positions, q, k, cos.double(), sin)
    with pytest.raises(ValueError, match="k must be"):
        qk_norm_rope_triton(positions, q, k.double(), cos, sin)
    with pytest.raises(ValueError, match="stride"):
        qk_norm_rope_triton(positions, q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)


# -- SiluAndMul ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, inter", [(1, 48), (4, 100), (1, 1100)])  # 1100: two column blocks
def test_silu_and_mul_matches_reference(dtype, num_tokens, inter, poisoned_empty):
    wide = _rand(num_tokens, 2 * inter + 6, dtype=dtype, seed=7, scale=3.0)
    x = wide[:, : 2 * inter]  # a row stride wider than 2I
    got, ref = silu_and_mul_triton(x), silu_and_mul_torch(x)
    assert not got.isnan().any()
    if dtype == torch.float32:
        # exp: numpy's vs torch's (~1 fp32 ulp), then + 1, / and *: four roundings per element.
        tol = rounding_tol(1, steps=4)
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    else:
        # The same fp32 exp difference flips an element only on a rounding boundary: <= 1 ulp per rounding.
        assert _ulps(got, ref) <= 2, _ulps(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, inter", [(1, 48), (4, 100), (1, 1100)])
def test_gelu_tanh_and_mul_matches_reference(dtype, num_tokens, inter, poisoned_empty):
    """GeGLU (Gemma) through the same kernel: its formula, g * sigmoid(2y), is the batch-invariant torch form's
    op for op (that form against transformers' GELU: tests/models/test_gemma.py); only exp differs (numpy's vs
    torch's), as for SiLU. And it is not SiLU."""
    x = _rand(num_tokens, 2 * inter + 6, dtype=dtype, seed=8, scale=3.0)[:, : 2 * inter]
    got, ref = silu_and_mul_triton(x, gelu_tanh=True), gelu_tanh_and_mul_invariant_torch(x)
    assert not got.isnan().any()
    if dtype == torch.float32:
        tol = rounding_tol(1, steps=4)  # exp's last bit, then + 1, / and *
        torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    else:
        assert _ulps(got, ref) <= 2, _ulps(got, ref)
    assert (got.float() - silu_and_mul_triton(x).float()).abs().max() > 0.1


def test_silu_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError):
        silu_and_mul_triton(_rand(2, 5))
    with pytest.raises(ValueError):
        silu_and_mul_triton(_rand(2, 3, 8))
    with pytest.raises(ValueError):
        silu_and_mul_triton(_rand(8, 2).t())


# -- KV-cache write ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=str)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 32), (3, 24)])
def test_write_kv_cache_matches_reference(src_dtype, cache_dtype, num_kv_heads, head_dim):
    num_blocks, block_size, num_tokens = 5, 4, 6
    sink = (num_blocks - 1) * block_size  # the CUDA-graph sink slot: padding rows all write there
    slots = torch.tensor([9, 2, 13, 0, sink, sink])
    kv = _rand(num_tokens, 3 * num_kv_heads, head_dim, dtype=src_dtype, seed=8, scale=3.0)
    k, v = kv[:, :num_kv_heads], kv[:, 2 * num_kv_heads :]  # strided views, as split from the projection
    kv[4:, 2 * num_kv_heads :] = 0
    kv[4:, :num_kv_heads] = 0  # padding rows: equal values, so the sink's content is defined
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=cache_dtype)
    ref = cache.clone()
    write_kv_cache_triton(cache, k, v, slots)
    write_kv_cache_torch(ref, k, v, slots)
    assert torch.equal(cache.isnan(), ref.isnan())  # the same slots written, every element of them
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())  # bit-exact: a single cast
    assert int((~cache.isnan()).sum()) == 2 * 5 * num_kv_heads * head_dim


def test_write_kv_cache_rejects_bad_inputs():
    cache = torch.zeros(2, 3, 4, 2, 8)
    k = v = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache_triton(cache, k, v, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="k must be"):
        write_kv_cache_triton(cache, torch.zeros(2, 1, 8), v, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="contiguous"):
        write_kv_cache_triton(cache.transpose(1, 2), k, v, torch.tensor([0, 1]))


# -- the references are the pre-fusion torch code, bit for bit ------------------------------------------------
# Frozen copies of layers.py / decoder.py / attention.py before the fused kernels: the CPU engine's numbers
# must not move.


def _old_rms_norm(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _old_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _old_rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _old_norm_rope(positions, q, k, cos_cache, sin_cache, q_w, k_w, eps, num_heads, num_kv_heads, head_dim):
    """q [T, Hq*D], k [T, Hkv*D] slices of the projection, as DecoderAttention + RotaryEmbedding did it."""
    num_tokens = q.shape[0]
    if q_w is not None:
        q = _old_rms_norm(q.reshape(num_tokens, num_heads, head_dim), q_w, eps).view(num_tokens, -1)
        k = _old_rms_norm(k.reshape(num_tokens, num_kv_heads, head_dim), k_w, eps).view(num_tokens, -1)
    cos = cos_cache[positions].to(q.dtype).unsqueeze(1)
    sin = sin_cache[positions].to(q.dtype).unsqueeze(1)
    q = _old_rotate(q.view(num_tokens, -1, head_dim), cos, sin).view(num_tokens, -1)
    k = _old_rotate(k.view(num_tokens, -1, head_dim), cos, sin).view(num_tokens, -1)
    return q, k


def _old_write_kv_cache(kv_cache, k, v, slot_mapping):
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_references_equal_the_pre_fusion_torch_code(dtype):
    from replayllm.model_runner_v2.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul
    from replayllm.rope_settings import RopeSettings

    assert not dispatch.use_fused_kernels(torch.device("cpu"))  # the default: torch path on CPU
    x, r = _rand(7, 96, dtype=dtype, seed=10, scale=3.0), _rand(7, 96, dtype=dtype, seed=11)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data.copy_(_rand(96, seed=12))
    assert torch.equal(norm(x), _old_rms_norm(x, norm.weight, 1e-6))
    normed, new_res = norm.add_and_norm(x, r)
    assert torch.equal(new_res, x + r) and torch.equal(normed, _old_rms_norm(x + r, norm.weight, 1e-6))
    assert torch.equal(rms_norm_torch(x, norm.weight, 1e-6), _old_rms_norm(x, norm.weight, 1e-6))

    gu = _rand(7, 2 * 80, dtype=dtype, seed=13, scale=3.0)
    assert torch.equal(SiluAndMul()(gu), _old_silu_and_mul(gu))

    rotary = RotaryEmbedding(32, 300, RopeSettings(theta=10000.0))
    for with_norm in (False, True):
        positions, q, k, _, _, q_w, k_w = _rope_case(5, 6, 2, 32, dtype, with_norm, seed=14)
        q_norm = k_norm = None
        if with_norm:
            q_norm, k_norm = RMSNorm(32, 1e-6).to(dtype), RMSNorm(32, 1e-6).to(dtype)
            q_norm.weight.data.copy_(q_w)
            k_norm.weight.data.copy_(k_w)
        old = _old_norm_rope(positions, q.reshape(5, -1), k.reshape(5, -1), rotary.cos_cache, rotary.sin_cache,
                             q_w, k_w, 1e-6, 6, 2, 32)
        new = rotary(positions, q, k, q_norm, k_norm)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])

    cache, old_cache = torch.zeros(2, 3, 4, 2, 16, dtype=dtype), torch.zeros(2, 3, 4, 2, 16, dtype=dtype)
    kv = _rand(4, 4, 16, seed=15)  # fp32 source: the cast to the cache dtype is part of the contract
    slots = torch.tensor([5, 0, 11, 11])
    write_kv_cache_torch(cache, kv[:, :2], kv[:, 2:], slots)  # the engine's CPU write
    _old_write_kv_cache(old_cache, kv[:, :2], kv[:, 2:], slots)
    assert torch.equal(cache, old_cache)


def test_dispatch_needs_the_switch_and_the_interpreter(monkeypatch):
    cpu = torch.device("cpu")
    assert not dispatch.use_fused_kernels(cpu)
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    assert dispatch.use_fused_kernels(cpu)  # conftest sets TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dispatch.use_fused_kernels(cpu)


# -- end to end: the engine with the fused path forced on CPU ------------------------------------------------


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the engine's launches of each fused kernel (through the names layers.py/attention.py call)."""
    from replayllm.model_runner_v2 import attention
    from replayllm.model_runner_v2.models import layers

    calls: dict[str, int] = {}

    def spy(module, name):
        fn = getattr(module, name)

        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if name == "qk_norm_rope_triton" and len(args) > 8 and args[8] is not None:  # its kv_write argument
                calls["kv_write_in_rope"] = calls.get("kv_write_in_rope", 0) + 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    for name in ("rms_norm_triton", "qk_norm_rope_triton", "silu_and_mul_triton"):
        spy(layers, name)
    spy(attention, "write_kv_cache_torch")
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_fused_path_matches_torch_path(tiny_models, arch, fused_calls, monkeypatch):
    from replayllm import LLM, SamplingParams

    prompts = [[5, 17, 300, 42, 8], [9, 3, 77]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", fused)
        llm = LLM(tiny_models[arch], device="cpu", dtype="float32", max_model_len=128, block_size=16,
                  skip_tokenizer_init=True, attention_backend="torch")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[fused] = [o.outputs[0] for o in outs]
        launched = set(fused_calls)
        # The KV write runs inside the rope kernel (kernels/rotary.py KVWrite), never as its own launch.
        expected = {"rms_norm_triton", "qk_norm_rope_triton", "silu_and_mul_triton", "kv_write_in_rope"}
        assert launched == (expected if fused else {"write_kv_cache_torch"}), launched
        assert fused_calls.get("kv_write_in_rope") == fused_calls.get("qk_norm_rope_triton")
        fused_calls.clear()
    worst = 0.0
    for a, b in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids):
            assert la[t].rank == lb[t].rank
            worst = max(worst, abs(la[t].logprob - lb[t].logprob))
    print(f"\n[fused e2e] {arch}: max |logprob fused - torch| = {worst:.2e}")
    assert math.isfinite(worst) and worst <= LOGPROB_TOL, worst  # other kernels: another summation order
