"""The skinny-GEMM kernel (`kernels/skinny_gemm.py`) under the Triton interpreter on small shapes: against the exact
(float64) product, with and without split-K and bias, strided and misaligned x, bad inputs, determinism and row
independence; its split rule and the dispatch (what runs F.linear). The compiled kernel on CUDA: the `gpu` tests
at the end, and bench/skinny_gemm_sweep.py (timings and max |diff| against F.linear at the Qwen3-0.6B shapes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import rounding_tol

from replayllm.kernels import dispatch
from replayllm.kernels import skinny_gemm as sg
from replayllm.model_runner_v2.models.layers import Linear

SMALL = sg.SkinnyTile(16, 32, 4, 1)  # interpreter-sized: K of 70-100 takes 3-4 steps, ragged tails


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
@pytest.mark.parametrize("m, n, k, splits, bias", [
    (1, 48, 96, 1, False),  # one split, N and K multiples of the tile: the unmasked loads
    (3, 40, 100, 3, True),  # split-K (bias added by the reduce), ragged N and K
    (16, 33, 70, 2, False),  # M = 16 (the most), a ragged last split
    (5, 40, 64, 1, True),  # one split with a bias
])
def test_matches_the_exact_product(dtype, m, n, k, splits, bias):
    x, w, b = _inputs(m, n, k, dtype, bias)
    out = sg.skinny_gemm_triton(x, w, b, tile=SMALL, splits=splits)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = _ref(x, w, b)
    err = (out.float() - ref).abs()
    assert (err <= _bound(x, w, b, ref)).all(), err.max()


def test_strided_misaligned_and_batched_x_give_the_contiguous_bits():
    x, w, b = _inputs(4, 40, 70, torch.bfloat16, True, seed=1)
    want = sg.skinny_gemm_triton(x, w, b, tile=SMALL, splits=2)
    wide = torch.zeros(4, 2 * 70, dtype=torch.bfloat16)
    wide[:, ::2] = x  # column stride 2
    shifted = torch.zeros(4 * 70 + 1, dtype=torch.bfloat16)[1:].view(4, 70)  # contiguous, 2 bytes off alignment
    shifted.copy_(x)
    assert shifted.data_ptr() % 16
    for view in (wide[:, ::2], shifted, x.T.contiguous().T):
        assert torch.equal(sg.skinny_gemm_triton(view, w, b, tile=SMALL, splits=2), want)
    batched = sg.skinny_gemm_triton(x.view(2, 2, 70), w, b, tile=SMALL, splits=2)
    assert batched.shape == (2, 2, 40) and torch.equal(batched.view(4, 40), want)


def test_launcher_rejects_bad_inputs():
    x, w, b = _inputs(2, 40, 64, torch.bfloat16, True)
    with pytest.raises(ValueError, match="1 to 16 rows, got M = 0"):
        sg.skinny_gemm_triton(x[:0], w, b)
    with pytest.raises(ValueError, match="1 to 16 rows, got M = 17"):
        sg.skinny_gemm_triton(torch.zeros(17, 64, dtype=torch.bfloat16), w, b)
    with pytest.raises(ValueError, match="share one dtype"):
        sg.skinny_gemm_triton(x, w.float(), b)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        sg.skinny_gemm_triton(x, w.T.contiguous().T, b)
    with pytest.raises(ValueError, match="x \\[..., K\\]"):
        sg.skinny_gemm_triton(x[:, :10], w, b)
    with pytest.raises(ValueError, match="bias must be"):
        sg.skinny_gemm_triton(x, w, b[:3])


def test_deterministic_and_rows_independent():
    """Two runs are bitwise equal (fixed split order, no atomics); a row's bits do not depend on the other rows
    or on M (the interpreter's dot is conftest's row-invariant einsum; a GPU's MMA computes rows alike too)."""
    x, w, b = _inputs(7, 40, 100, torch.bfloat16, True, seed=2)
    first = sg.skinny_gemm_triton(x, w, b, tile=SMALL, splits=3)
    assert torch.equal(sg.skinny_gemm_triton(x, w, b, tile=SMALL, splits=3), first)
    for i in (0, 6):
        assert torch.equal(sg.skinny_gemm_triton(x[i : i + 1], w, b, tile=SMALL, splits=3), first[i : i + 1])


def test_split_rule_fills_the_gpu_for_every_qwen3_shape():
    """Pure function of (N, K, tile, SM count): every Qwen3-0.6B linear gets >= 2 programs per SM on 132 SMs
    with the default tile, whole BLOCK_K steps per split and no empty split; one split without an SM count."""
    tile = sg.DEFAULT_TILE
    want = {(4096, 1024): 2, (1024, 2048): 8, (6144, 1024): 2, (1024, 3072): 6, (151936, 1024): 1}
    for (n, k), splits in want.items():
        got = sg.skinny_splits(n, k, tile, 132)
        assert got == splits, (n, k, got)
        assert -(-n // tile.block_n) * got >= 2 * 132
        k_steps = -(-k // tile.block_k)
        assert (got - 1) * -(-k_steps // got) < k_steps  # the last split (of cdiv(steps, splits) steps) not empty
        assert sg.skinny_splits(n, k, tile, None) == 1


def test_tile_override(monkeypatch):
    monkeypatch.delenv(sg._TILE_ENV, raising=False)
    assert sg.skinny_tile(4096, 1024) == (sg.DEFAULT_TILE, None)
    monkeypatch.setenv(sg._TILE_ENV, "32,128,2,4")
    assert sg.skinny_tile(4096, 1024) == (sg.SkinnyTile(32, 128, 2, 4), None)
    monkeypatch.setenv(sg._TILE_ENV, "16,32,4,1,3")
    assert sg.skinny_tile(40, 100) == (SMALL, 3)
    x, w, _ = _inputs(2, 40, 100, torch.bfloat16, False)
    assert torch.equal(sg.skinny_gemm_triton(x, w), sg.skinny_gemm_triton(x, w, tile=SMALL, splits=3))
    monkeypatch.setenv(sg._TILE_ENV, "16,32")
    with pytest.raises(ValueError, match="REPLAYLLM_SKINNY_TILE"):
        sg.skinny_tile(40, 100)


def test_dispatch(monkeypatch):
    """F.linear on CPU (nothing changes there), for fp32, for M = 0 or M > SKINNY_MAX_M and with the switch off;
    the kernel where the fused kernels run (CPU only under the interpreter, as a test asks) for 1..SKINNY_MAX_M
    bf16/fp16 rows, once the switch is on (off by default, REPLAYLLM_SKINNY_GEMM=1). Linear.forward goes through
    the dispatcher."""
    x, w, b = _inputs(3, 40, 64, torch.bfloat16, True)
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    assert not sg.ENABLED or os.environ.get("REPLAYLLM_SKINNY_GEMM") == "1"
    assert sg.ENABLED or not sg.skinny_gemm_applies(x, w)  # off by default, even where the kernels run
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", False)
    monkeypatch.setattr(sg, "ENABLED", True)
    assert not sg.skinny_gemm_applies(x, w)  # CPU: the fused kernels are off by default
    assert torch.equal(sg.skinny_gemm(x, w, b), F.linear(x, w, b))
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    assert sg.skinny_gemm_applies(x, w)
    assert sg.skinny_gemm_applies(x.view(1, 3, 64), w)
    assert not sg.skinny_gemm_applies(x.float(), w.float())
    assert not sg.skinny_gemm_applies(x[:0], w)
    assert not sg.skinny_gemm_applies(torch.zeros(sg.SKINNY_MAX_M + 1, 64, dtype=torch.bfloat16), w)
    assert not sg.skinny_gemm_applies(x, w.T.contiguous().T)
    layer = Linear(64, 40, bias=True).to(torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    calls = []
    monkeypatch.setattr(sg, "skinny_gemm_triton", lambda *a: calls.append(a) or F.linear(*a))
    layer(x)
    assert len(calls) == 1
    monkeypatch.setattr(sg, "ENABLED", False)
    assert not sg.skinny_gemm_applies(x, w)
    layer(x)
    assert len(calls) == 1


# -- compiled, CUDA (marker `gpu`; bench/gpu_check.sh runs this file with TRITON_INTERPRET=0) ------------------

QWEN3_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", QWEN3_SHAPES)
def test_compiled_kernel_at_the_qwen3_shapes(n, k):
    """Every M of 1..16 against the exact product within the derived bound, the default tile and split rule;
    two runs bitwise equal; a row's bits the same alone and in the batch."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    x = torch.randn(16, k, generator=g, device="cuda").to(torch.bfloat16)
    for m in (1, 2, 3, 8, 16):
        for bias in (None, b):
            out = sg.skinny_gemm_triton(x[:m], w, bias)
            ref = _ref(x[:m], w, bias)
            err = (out.float() - ref).abs()
            assert (err <= _bound(x[:m], w, bias, ref)).all(), (m, err.max())
            assert torch.equal(sg.skinny_gemm_triton(x[:m], w, bias), out)
            assert torch.equal(out[-1:], sg.skinny_gemm_triton(x[m - 1 : m], w, bias))


@pytest.mark.gpu
def test_compiled_kernel_in_a_cuda_graph():
    """Captured after one eager call (as the runner's captures are), replayed with new x: bitwise the eager result,
    split-K (o_proj's shape) and one split (the LM head's) alike."""
    for n, k in ((1024, 2048), (151936, 1024)):
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        x = torch.randn(4, k, device="cuda").to(torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sg.skinny_gemm_triton(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sg.skinny_gemm_triton(x, w)
        x.copy_(torch.randn(4, k, device="cuda").to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, sg.skinny_gemm_triton(x, w))
