"""The LayerNorm kernel (`kernels/layer_norm.py`) against its plain-torch reference (torch's layer_norm, HF's
nn.LayerNorm op for op): with and without the residual add, with weight and bias, bias-free, parameter-free (OLMo)
and scaled by weight + 1 (Nemotron's LayerNorm1P), rows wider than a power of two, under the interpreter here and
compiled on CUDA (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol

from replayllm.kernels.layer_norm import layer_norm_torch, layer_norm_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0, shift=0.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(device)


def _assert_layer_norm_close(got: torch.Tensor, ref: torch.Tensor, hidden: int) -> None:
    """Both compute one fp32 value per element and round it once; their statistics are summed in other orders
    (torch: a Welford pass; the kernel: two plain sums over `hidden` terms), so the fp32 values differ by at most
    rounding_tol at the output's scale, and a 16-bit output by that plus one ulp of its dtype (the rounding of a
    value next to a boundary may go either way)."""
    tol = rounding_tol(ref.float(), terms=hidden, steps=3)
    diff = (got.double() - ref.double()).abs()
    if got.dtype != torch.float32:
        ulp = torch.finfo(ref.dtype).eps * torch.exp2(torch.floor(torch.log2(ref.double().abs().clamp(min=1e-30))))
        assert (diff <= ulp + tol).all(), float((diff - ulp).max())
        assert (got != ref).float().mean() < 0.05  # nearly all elements bit-exact
    else:
        assert float(diff.max()) <= tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200])  # 200: a masked tail in the row's power-of-two block
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("params", ["weight_bias", "weight", "none", "unit_offset"])  # unit_offset: Nemotron's
def test_layer_norm_matches_reference(dtype, hidden, with_residual, params):
    # Rows with a mean far from 0 (shift 4): a one-pass variance (E[x^2] - mean^2) would cancel badly here.
    x = _rand(5, hidden, dtype=dtype, seed=1, scale=3.0, shift=4.0)
    w = _rand(hidden, dtype=dtype, seed=2) if params != "none" else None
    b = _rand(hidden, dtype=dtype, seed=3) if params == "weight_bias" else None
    # A strided residual (the first half of a wider buffer's rows): row strides are honoured.
    residual = _rand(5, 2 * hidden, dtype=dtype, seed=4)[:, :hidden] if with_residual else None
    one_p = params == "unit_offset"
    b = _rand(hidden, dtype=dtype, seed=3) if one_p else b
    got = layer_norm_triton(x, w, b, 1e-5, residual, unit_offset=one_p)
    ref = layer_norm_torch(x, w, b, 1e-5, residual, unit_offset=one_p)
    if with_residual:
        assert torch.equal(got[1], ref[1])  # the add: one rounding, bit-exact
        got, ref = got[0], ref[0]
    assert not got.isnan().any()
    _assert_layer_norm_close(got, ref, hidden)


def test_reference_is_hf_layer_norm_and_olmos():
    """The torch path is nn.LayerNorm's op (GPT-2, OPT, ...) and, without parameters, OLMo's fp32 norm cast back."""
    x = _rand(3, 48, dtype=torch.bfloat16, seed=5, scale=2.0)
    ln = torch.nn.LayerNorm(48, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.copy_(_rand(48, seed=6))
        ln.bias.copy_(_rand(48, seed=7))
        assert torch.equal(layer_norm_torch(x, ln.weight, ln.bias, 1e-5), ln(x))
    olmo = torch.nn.functional.layer_norm(x.float(), (48,), None, None, 1e-5).to(torch.bfloat16)
    assert torch.equal(layer_norm_torch(x, None, None, 1e-5), olmo)


def test_layer_norm_3d_input_and_bad_inputs():
    x = _rand(2, 3, 32, seed=8)
    w, b = _rand(32, seed=9), _rand(32, seed=10)
    _assert_layer_norm_close(layer_norm_triton(x, w, b, 1e-5), layer_norm_torch(x, w, b, 1e-5), 32)
    with pytest.raises(ValueError, match="needs a weight"):
        layer_norm_triton(x, None, b, 1e-5)
    with pytest.raises(ValueError, match="needs a weight"):
        layer_norm_triton(x, None, None, 1e-5, unit_offset=True)
    with pytest.raises(ValueError, match="weight"):
        layer_norm_triton(x, w.double(), b, 1e-5)
    with pytest.raises(ValueError, match="bias"):
        layer_norm_triton(x, w, _rand(31), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        layer_norm_triton(x, w, b, 1e-5, x[:1])
    with pytest.raises(ValueError, match="stride"):
        layer_norm_triton(x.transpose(1, 2), _rand(3), _rand(3), 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        layer_norm_triton(x.double(), w.double(), b.double(), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [2048, 4544])  # StarCoderBase-1B's, Falcon-7B's (not a power of two)
def test_layer_norm_on_cuda(dtype, hidden):
    """Compiled: torch's CUDA layer_norm (the path the kernel replaced) as the reference, 300 rows."""
    dev = "cuda"
    x = _rand(300, hidden, dtype=dtype, seed=11, scale=3.0, shift=1.0, device=dev)
    w, b = _rand(hidden, dtype=dtype, seed=12, device=dev), _rand(hidden, dtype=dtype, seed=13, device=dev)
    residual = _rand(300, hidden, dtype=dtype, seed=14, device=dev)
    got, new_res = layer_norm_triton(x, w, b, 1e-5, residual)
    ref, ref_res = layer_norm_torch(x, w, b, 1e-5, residual)
    assert torch.equal(new_res, ref_res)
    _assert_layer_norm_close(got.cpu(), ref.cpu(), hidden)
    _assert_layer_norm_close(layer_norm_triton(x, None, None, 1e-5).cpu(),
                             layer_norm_torch(x, None, None, 1e-5).cpu(), hidden)
    _assert_layer_norm_close(layer_norm_triton(x, w, b, 1e-5, unit_offset=True).cpu(),
                             layer_norm_torch(x, w, b, 1e-5, unit_offset=True).cpu(), hidden)
