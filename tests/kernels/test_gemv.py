"""The GEMV kernel (`kernels/gemv.py`) under the Triton interpreter on small shapes: against the exact (float64)
product, with and without bias, ragged N and K, strided x, bad inputs, determinism; its tile override, the
rule of when it runs and the dispatch (what runs F.linear). The compiled kernel on CUDA: the `gpu` tests at the
end, and bench/gemv_sweep.py (timings and max |diff| against F.linear at the Qwen3-0.6B shapes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import rounding_tol

from replayllm.kernels import dispatch, gemv
from replayllm.model_runner_v2.models import layers
from replayllm.model_runner_v2.models.layers import Linear

SMALL = gemv.GemvTile(4, 32, 2)  # interpreter-sized: K of 70-100 takes 3-4 unrolled chunks, a ragged last one


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |kernel - ref|, ref = x @ w^T (+ b) of the same (rounded) inputs in float64.

    The kernel adds the K products (exact in fp32 for bf16/fp16 inputs) in fp32 in its own order; against the
    exact sum (or another fp32 order) that errs by delta <= rounding_tol(S, terms=K), S the largest sum of
    |x_k w_k| (+ |b|), the magnitude the partial sums reach. The kernel then rounds its sum y once to the
    dtype: |round(y) - y| <= eps/2 * |y| (eps = torch.finfo(dtype).eps: an ulp at |y| is at most eps * |y|),
    and |y| <= |ref| + delta. So |out - ref| <= eps/2 * (|ref| + delta) + delta."""
    scale = x.float().abs() @ w.float().abs().T
    if b is not None:
        scale = scale + b.float().abs()
    delta = rounding_tol(scale, terms=x.shape[-1])
    return torch.finfo(x.dtype).eps / 2 * (ref.abs() + delta) + delta


def _ref(x, w, b):
    """x @ w^T (+ b) in float64 (exact up to fp64 rounding; on CUDA immune to TF32 settings)."""
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m, n, k, bias", [
    (1, 48, 96, False),  # N and K multiples of the tile: the unmasked loads
    (3, 41, 100, True),  # M_PAD 4, ragged N and K, a bias
    (4, 33, 70, False),  # M = GEMV_MAX_M
    (2, 40, 20, True),  # K below one chunk
])
def test_matches_the_exact_product(dtype, m, n, k, bias):
    x, w, b = _inputs(m, n, k, dtype, bias)
    out = gemv.gemv_triton(x, w, b, tile=SMALL)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = _ref(x, w, b)
    err = (out.float() - ref).abs()
    assert (err <= _bound(x, w, b, ref)).all(), err.max()


def test_default_tile_and_strided_x():
    """The default tile (one 1024-wide chunk, masked to K) gives the exact product too; a strided or batched x
    gives the contiguous x's bits."""
    x, w, b = _inputs(3, 40, 70, torch.bfloat16, True, seed=1)
    want = gemv.gemv_triton(x, w, b)
    ref = _ref(x, w, b)
    assert ((want.float() - ref).abs() <= _bound(x, w, b, ref)).all()
    wide = torch.zeros(3, 2 * 70, dtype=torch.bfloat16)
    wide[:, ::2] = x  # column stride 2
    assert torch.equal(gemv.gemv_triton(wide[:, ::2], w, b), want)
    batched = gemv.gemv_triton(x.view(3, 1, 70), w, b)
    assert batched.shape == (3, 1, 40) and torch.equal(batched.view(3, 40), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_prologue_is_silu_and_mul_then_the_gemv(dtype):
    """silu_mul=True on gate | up [M, 2K] gives the bits of the SiluAndMul kernel followed by the plain GEMV, and
    gemv_torch(silu_mul=True) within the derived bound of the exact product of that activation."""
    from replayllm.kernels.activation import silu_and_mul_triton

    g = torch.Generator().manual_seed(3)
    gate_up = (4 * torch.randn(3, 2 * 70, generator=g)).to(dtype)
    w = torch.randn(41, 70, generator=g).to(dtype)
    b = torch.randn(41, generator=g).to(dtype)
    fused = gemv.gemv_triton(gate_up, w, b, tile=SMALL, silu_mul=True)
    act = silu_and_mul_triton(gate_up)
    assert torch.equal(fused, gemv.gemv_triton(act, w, b, tile=SMALL))
    ref = _ref(act, w, b)
    assert ((fused.float() - ref).abs() <= _bound(act, w, b, ref)).all()
    assert torch.equal(gemv.gemv_torch(gate_up, w, b, silu_mul=True), gemv.gemv_torch(act, w, b))
    with pytest.raises(ValueError, match="gate \\| up"):
        gemv.gemv_triton(act, w, b, silu_mul=True)


def _decoder_layer():
    from replayllm.model_runner_v2.models.decoder import DecoderMLP, DecoderSpec
    from replayllm.model_runner_v2.models.layers import RMSNorm

    torch.manual_seed(4)
    cfg = SimpleNamespace(hidden_size=48, intermediate_size=80, hidden_act="silu")
    mlp = DecoderMLP(cfg, DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=True, qk_norm=False))
    norm = RMSNorm(48, 1e-6)
    for module in (mlp, norm):
        module.to(torch.bfloat16)
        for p in module.parameters():
            p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.3 + (1 if module is norm else 0))
    return mlp, norm


def test_mlp_fuses_its_norm_and_silu_where_the_gemv_runs(monkeypatch):
    """DecoderMLP on a one-row step where the fused kernels run (the interpreter here): the post-attention norm
    goes inside the gate | up GEMV and SiluAndMul inside down_proj's; the output and the new residual match the
    unfused path (the norm's kernel, then the GEMV, then SiluAndMul's kernel, then the GEMV) within a rounding
    step of the normed input; batch-invariant layers never fuse."""
    mlp, norm = _decoder_layer()
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    monkeypatch.setattr(gemv, "ENABLED", True)
    x, residual = torch.randn(2, 1, 48).to(torch.bfloat16)
    calls = []
    def spy(name, real):
        def call(*args, **kwargs):
            calls.append((name, kwargs))
            return real(*args, **kwargs)
        return call

    for name in ("gemv_triton", "norm_gemv_triton"):  # seen from layers.py and from gemv.linear
        monkeypatch.setattr(layers, name, spy(name, getattr(gemv, name)))
        monkeypatch.setattr(gemv, name, getattr(layers, name))
    fused, new_residual = mlp(x, residual, norm)
    assert [(n, kw.get("silu_mul", False)) for n, kw in calls] == [("norm_gemv_triton", False),
                                                                   ("gemv_triton", True)]
    assert torch.equal(new_residual, x + residual)
    monkeypatch.setattr(layers.Linear, "norm_matmul", lambda *a: None)
    monkeypatch.setattr(layers.Linear, "silu_mul_matmul", lambda *a: None)
    calls.clear()
    plain, plain_residual = mlp(x, residual, norm)
    assert [(n, kw.get("silu_mul", False)) for n, kw in calls] == [("gemv_triton", False)] * 2
    assert torch.equal(plain_residual, new_residual)
    # One rounding step of a normed element moves the output by at most |w| * ulp: far below this bound.
    assert (fused.float() - plain.float()).abs().max() <= 0.05 * plain.float().abs().max()
    monkeypatch.undo()
    mlp.down_proj.batch_invariant = mlp.gate_up_proj.batch_invariant = True
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    assert mlp.down_proj.silu_mul_matmul(torch.zeros(1, 160).to(torch.bfloat16)) is None
    assert mlp.gate_up_proj.norm_matmul(x, residual, norm) is None


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_norm_prologue_matches_the_reference(m, with_residual):
    """norm_gemv_triton against norm_gemv_torch (rms_norm_torch, then the exact-order GEMV): the new residual
    bitwise, the output within the GEMV's bound plus one rounding step of each normed element (its 1 / rms is
    summed in another order)."""
    g = torch.Generator().manual_seed(5 + m)
    x = torch.randn(m, 70, generator=g).to(torch.bfloat16)
    residual = torch.randn(m, 70, generator=g).to(torch.bfloat16) if with_residual else None
    gain = (1 + 0.3 * torch.randn(70, generator=g)).to(torch.bfloat16)
    w = torch.randn(41, 70, generator=g).to(torch.bfloat16)
    b = torch.randn(41, generator=g).to(torch.bfloat16)
    out, new_residual = gemv.norm_gemv_triton(x, residual, gain, 1e-6, w, b, tile=SMALL)
    ref, ref_residual = gemv.norm_gemv_torch(x, residual, gain, 1e-6, w, b)
    assert torch.equal(new_residual, ref_residual)
    from replayllm.kernels.rms_norm import rms_norm_torch

    normed = rms_norm_torch(x if residual is None else x + residual, gain, 1e-6)
    exact = _ref(normed, w, b)
    step = torch.finfo(torch.bfloat16).eps * (normed.float().abs() @ w.float().abs().T)  # one ulp per element
    assert ((out.float() - exact).abs() <= _bound(normed, w, b, exact) + step).all()
    assert ((ref.float() - exact).abs() <= _bound(normed, w, b, exact)).all()
    with pytest.raises(ValueError, match="norm_weight must be"):
        gemv.norm_gemv_triton(x, residual, gain.float(), 1e-6, w, b)
    with pytest.raises(ValueError, match="residual must match"):
        gemv.norm_gemv_triton(x, x[:, :10], gain, 1e-6, w, b)


def test_launcher_rejects_bad_inputs():
    x, w, b = _inputs(2, 40, 64, torch.bfloat16, True)
    with pytest.raises(ValueError, match="1 to 4 rows, got M = 0"):
        gemv.gemv_triton(x[:0], w, b)
    with pytest.raises(ValueError, match="1 to 4 rows, got M = 5"):
        gemv.gemv_triton(torch.zeros(5, 64, dtype=torch.bfloat16), w, b)
    with pytest.raises(ValueError, match="share one dtype"):
        gemv.gemv_triton(x, w.float(), b)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv.gemv_triton(x, w.T.contiguous().T, b)
    with pytest.raises(ValueError, match="x \\[..., K\\]"):
        gemv.gemv_triton(x[:, :10], w, b)
    with pytest.raises(ValueError, match="bias must be"):
        gemv.gemv_triton(x, w, b[:3])


def test_deterministic_and_rows_independent_of_their_neighbours():
    """Two runs are bitwise equal (a fixed order of the sum); a row's bits do not depend on the other rows' values
    (the same M: a different M_PAD may lay the sum out differently on a GPU)."""
    x, w, b = _inputs(4, 40, 100, torch.bfloat16, True, seed=2)
    first = gemv.gemv_triton(x, w, b, tile=SMALL)
    assert torch.equal(gemv.gemv_triton(x, w, b, tile=SMALL), first)
    other = x.clone()
    other[1:] = torch.randn(3, 100).to(torch.bfloat16)
    assert torch.equal(gemv.gemv_triton(other, w, b, tile=SMALL)[0], first[0])


def test_tile_override(monkeypatch):
    monkeypatch.delenv(gemv._TILE_ENV, raising=False)
    assert gemv.gemv_tile(4096, 1024) == gemv.DEFAULT_TILE
    monkeypatch.setenv(gemv._TILE_ENV, "4,32,2")
    assert gemv.gemv_tile(40, 100) == SMALL
    x, w, _ = _inputs(2, 40, 100, torch.bfloat16, False)
    assert torch.equal(gemv.gemv_triton(x, w), gemv.gemv_triton(x, w, tile=SMALL))
    assert gemv.gemv_tile(40, 100, gemv.NORM_ADD) == SMALL  # forces the norm prologue's tile too
    monkeypatch.setenv(gemv._NORM_TILE_ENV, "8,64,2")
    assert gemv.gemv_tile(40, 100, gemv.NORM) == gemv.GemvTile(8, 64, 2)
    assert gemv.gemv_tile(40, 100, gemv.SILU_MUL) == SMALL
    monkeypatch.delenv(gemv._NORM_TILE_ENV)
    for bad in ("4,32", "3,32,2", "4,0,2", "a,b,c"):
        monkeypatch.setenv(gemv._TILE_ENV, bad)
        with pytest.raises(ValueError, match="REPLAYLLM_GEMV_TILE"):
            gemv.gemv_tile(40, 100)
    monkeypatch.delenv(gemv._TILE_ENV)
    assert gemv.gemv_tile(40, 100, gemv.NORM) == gemv.NORM_TILE


def test_when_it_runs():
    """One row: every layer weight, not the LM head; more rows: never (the library GEMM, until measured end to
    end)."""
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)):
        assert gemv.gemv_wanted(1, n, k) == (n != 151936)
        for m in range(2, gemv.GEMV_MAX_M + 2):
            assert not gemv.gemv_wanted(m, n, k)


def test_dispatch(monkeypatch):
    """F.linear on CPU (nothing changes there), for fp32, for M = 0 or more than one row, an LM-head-like N and with
    the switch off (REPLAYLLM_GEMV=0); the kernel where the fused kernels run (CPU only under the interpreter, as a
    test asks) for one row. Linear.forward goes through the dispatcher."""
    x, w, b = _inputs(1, 40, 64, torch.bfloat16, True)
    monkeypatch.setattr(gemv, "ENABLED", True)
    assert not gemv.gemv_applies(x, w)  # CPU: the fused kernels are off by default
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    assert gemv.gemv_applies(x, w)
    assert gemv.gemv_applies(x.view(1, 1, 64), w)
    assert not gemv.gemv_applies(x.float(), w.float())
    assert not gemv.gemv_applies(x[:0], w)
    assert not gemv.gemv_applies(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    assert not gemv.gemv_applies(x, w.T.contiguous().T)
    assert gemv.gemv_applies(x, torch.zeros(512, 64, dtype=torch.bfloat16))  # N = 8K
    assert not gemv.gemv_applies(x, torch.zeros(513, 64, dtype=torch.bfloat16))  # an LM-head-like N > 8K
    layer = Linear(64, 40, bias=True).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    calls = []
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a: calls.append(a) or F.linear(*a))
    layer(x)
    assert len(calls) == 1
    monkeypatch.setattr(gemv, "ENABLED", False)
    assert not gemv.gemv_applies(x, w)
    layer(x)
    assert len(calls) == 1


def test_env_switch(monkeypatch):
    monkeypatch.setenv("REPLAYLLM_GEMV", "0")
    assert not dispatch.env_flag("REPLAYLLM_GEMV")
    monkeypatch.setenv("REPLAYLLM_GEMV", "yes")
    with pytest.raises(ValueError, match="REPLAYLLM_GEMV must be 0 or 1"):
        dispatch.env_flag("REPLAYLLM_GEMV")


# -- compiled, CUDA (marker `gpu`; bench/gpu_check.sh runs this file with TRITON_INTERPRET=0) ------------------

QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", QWEN3_SHAPES)
def test_compiled_kernel_at_the_qwen3_shapes(n, k):
    """Every M of 1..4 against the exact product within the derived bound, the default tile; two runs bitwise
    equal."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, k, generator=g, device="cuda").to(torch.bfloat16)
    for m in (1, 2, 3, 4):
        for bias in (None, b):
            out = gemv.gemv_triton(x[:m], w, bias)
            ref = _ref(x[:m], w, bias)
            err = (out.float() - ref).abs()
            assert (err <= _bound(x[:m], w, bias, ref)).all(), (m, err.max())
            assert torch.equal(gemv.gemv_triton(x[:m], w, bias), out)


@pytest.mark.gpu
def test_compiled_kernel_in_a_cuda_graph():
    """Captured after one eager call (as the runner's captures are), replayed with new x: bitwise the eager result
    (o_proj's shape and the LM head's)."""
    for n, k in ((1024, 2048), (151936, 1024)):
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            gemv.gemv_triton(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gemv.gemv_triton(x, w)
        x.copy_(torch.randn(1, k, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv.gemv_triton(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_compiled_prologues_at_the_qwen3_shapes(m):
    """The norm prologue (qkv 4096 x 1024, with and without the residual add) and the SiLU·mul prologue (down
    1024 x 3072) compiled: the new residual bitwise torch's add; the outputs within the GEMV's bound (plus one
    rounding step of each normed element for the norm) of the exact product of the reference's input."""
    from replayllm.kernels.activation import silu_and_mul_torch
    from replayllm.kernels.rms_norm import rms_norm_torch

    g = torch.Generator(device="cuda").manual_seed(m)
    bf = torch.bfloat16
    x, res = (torch.randn(2, m, 1024, generator=g, device="cuda") * 3).to(bf)
    gain = (1 + 0.2 * torch.randn(1024, generator=g, device="cuda")).to(bf)
    w = (torch.randn(4096, 1024, generator=g, device="cuda") / 32).to(bf)
    for residual in (None, res):
        out, new_residual = gemv.norm_gemv_triton(x, residual, gain, 1e-6, w)
        normed = rms_norm_torch(x if residual is None else x + residual, gain, 1e-6)
        assert torch.equal(new_residual, x if residual is None else x + residual)
        exact = _ref(normed, w, None)
        step = torch.finfo(bf).eps * (normed.float().abs() @ w.float().abs().T)
        assert ((out.float() - exact).abs() <= _bound(normed, w, None, exact) + step).all()
    gate_up = (torch.randn(m, 2 * 3072, generator=g, device="cuda") * 2).to(bf)
    down = (torch.randn(1024, 3072, generator=g, device="cuda") / 55).to(bf)
    act = silu_and_mul_torch(gate_up)
    out = gemv.gemv_triton(gate_up, down, silu_mul=True)
    exact = _ref(act, down, None)
    # F.silu on CUDA and the kernel's gate / (1 + exp(-gate)) may round an activation one step apart.
    step = torch.finfo(bf).eps * (act.float().abs() @ down.float().abs().T)
    assert ((out.float() - exact).abs() <= _bound(act, down, None, exact) + step).all()
