"""A norm of a sub-block's output, the residual add and the next sub-block's norm in one RMSNorm launch
(kernels/rms_norm.py `first_weight`, FIRST_NORM): Gemma 2 / 3's post-attention + pre-feedforward norms and GLM-4's
post-self-attention + post-attention norms. The fused launch against the two launches it replaces, bit for bit (the
same kernel code per norm), and against the torch reference; `RMSNorm.add_and_norm(first=)` uses it on the fused
path, and keeps the first norm a module call where a forward hook watches it (`replayllm diff --localize`)."""

from __future__ import annotations

import pytest
import torch
from helpers.tolerances import rounding_tol

from replayllm.kernels import dispatch
from replayllm.kernels.rms_norm import rms_norm_torch, rms_norm_triton
from replayllm.model_runner_v2.models import layers

ORDERS = {"llama": {}, "fp32_weight": dict(weight_in_fp32=True), "unit_offset": dict(unit_offset=True)}


def _case(dtype, rows=5, hidden=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    first_w, w = ((torch.randn(hidden, generator=g) * 0.5).to(dtype) for _ in range(2))
    return x, residual, first_w, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("order", list(ORDERS))
def test_one_launch_equals_the_two_it_replaces(dtype, order):
    x, residual, first_w, w = _case(dtype)
    normed, new_residual = rms_norm_triton(x, w, 1e-6, residual, first_weight=first_w, first_eps=1e-5,
                                           **ORDERS[order])
    first = rms_norm_triton(x, first_w, 1e-5, **ORDERS[order])
    two_normed, two_residual = rms_norm_triton(first, w, 1e-6, residual, **ORDERS[order])
    assert torch.equal(new_residual, two_residual) and torch.equal(normed, two_normed)
    # against the torch reference (the per-row mean of squares summed in another order)
    ref_normed, ref_residual = rms_norm_torch(x, w, 1e-6, residual, first_weight=first_w, first_eps=1e-5,
                                              **ORDERS[order])
    for got, ref in ((normed, ref_normed), (new_residual, ref_residual)):
        if dtype == torch.float32:
            tol = rounding_tol(1, terms=x.shape[-1], steps=4)
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
        else:
            assert (got.float() - ref.float()).abs().max() <= 4 * torch.finfo(dtype).eps * ref.abs().max().float()
    # the first norm did run: without it the residual would be x + residual
    assert not torch.equal(new_residual, x + residual)


def test_the_reference_is_the_first_norm_then_the_add_and_norm():
    x, residual, first_w, w = _case(torch.bfloat16)
    got = rms_norm_torch(x, w, 1e-6, residual, unit_offset=True, first_weight=first_w, first_eps=1e-5)
    want = rms_norm_torch(rms_norm_torch(x, first_w, 1e-5, unit_offset=True), w, 1e-6, residual, unit_offset=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_bad_first_weight():
    x, residual, first_w, w = _case(torch.float32)
    with pytest.raises(ValueError, match="first_weight needs a residual"):
        rms_norm_triton(x, w, 1e-6, first_weight=first_w)
    with pytest.raises(ValueError, match="first_weight"):
        rms_norm_triton(x, w, 1e-6, residual, first_weight=first_w[:-1])
    with pytest.raises(ValueError, match="first_weight needs a residual"):
        rms_norm_torch(x, w, 1e-6, first_weight=first_w)


def _norms(dtype, unit_offset=True):
    x, residual, first_w, w = _case(dtype)
    post, pre = layers.RMSNorm(x.shape[-1], 1e-5, unit_offset=unit_offset), layers.RMSNorm(x.shape[-1], 1e-6,
                                                                                          unit_offset=unit_offset)
    post.weight.data, pre.weight.data = first_w, w
    return x, residual, post, pre


def test_add_and_norm_with_first_is_one_launch_on_the_fused_path(monkeypatch):
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    calls = []
    real = layers.rms_norm_triton
    monkeypatch.setattr(layers, "rms_norm_triton", lambda *a, **k: calls.append(a) or real(*a, **k))
    x, residual, post, pre = _norms(torch.bfloat16)
    normed, new_residual = pre.add_and_norm(x, residual, first=post)
    assert len(calls) == 1  # the fused launch: no launch of `post` of its own
    two = pre.add_and_norm(post(x), residual)
    assert torch.equal(normed, two[0]) and torch.equal(new_residual, two[1])
    # a forward hook on the first norm (diff --localize) sees its output: then it runs as its own module call
    seen = []
    post.register_forward_hook(lambda module, args, out: seen.append(out))
    calls.clear()
    hooked = pre.add_and_norm(x, residual, first=post)
    assert len(seen) == 1 and len(calls) == 2 and torch.equal(seen[0], post(x))
    assert torch.equal(hooked[0], normed) and torch.equal(hooked[1], new_residual)


def test_add_and_norm_with_first_on_the_torch_path_and_unlike_orders(monkeypatch):
    """The CPU engine (torch ops): the first norm's module call, then the add and norm, as before. Norms of two
    orders (not a model of ours, but allowed) also take that route rather than one fused order."""
    x, residual, post, pre = _norms(torch.bfloat16)
    got = pre.add_and_norm(x, residual, first=post)
    want = rms_norm_torch(rms_norm_torch(x, post.weight, 1e-5, unit_offset=True), pre.weight, 1e-6, residual,
                          unit_offset=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    llama_post = layers.RMSNorm(x.shape[-1], 1e-5)
    llama_post.weight.data = post.weight.data
    mixed = pre.add_and_norm(x, residual, first=llama_post)
    separate = pre.add_and_norm(llama_post(x), residual)
    assert torch.equal(mixed[0], separate[0]) and torch.equal(mixed[1], separate[1])


@pytest.mark.gpu
@pytest.mark.parametrize("order", list(ORDERS))
def test_one_launch_equals_two_on_cuda(order):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the compiled kernel)")
    x, residual, first_w, w = (t.cuda() for t in _case(torch.bfloat16, rows=37, hidden=1152))  # Gemma-3-1B's
    normed, new_residual = rms_norm_triton(x, w, 1e-6, residual, first_weight=first_w, first_eps=1e-6,
                                           **ORDERS[order])
    two = rms_norm_triton(rms_norm_triton(x, first_w, 1e-6, **ORDERS[order]), w, 1e-6, residual, **ORDERS[order])
    assert torch.equal(new_residual, two[1]) and torch.equal(normed, two[0])
