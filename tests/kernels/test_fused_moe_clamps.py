"""The fused MoE kernel's clamped activations (kernels/fused_moe.py's CLAMP_SILU and CLIP_SILU branches) against the
plain-torch loop, independent of any transformers release: HY-V4's / DeepSeek-V4's ClampedSiLU (the gate and up
clamped, then SwiGLU) and Ling 3's / Step 3.7's ClippedSwiGLU (SiLU's output capped, up clamped). Under the Triton
interpreter on the CPU; compiled on CUDA (marker `gpu`, bench/gpu_check.sh). Each activation's reference against
transformers' own experts: tests/models/test_hy_v4.py, tests/models/test_bailing_hybrid.py."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.tolerances import magnitude, rounding_tol

from replayllm.kernels.activation import ClampedSiLU, ClippedSwiGLU
from replayllm.kernels.fused_moe import fused_experts_torch, fused_experts_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the kernel: compiled on CUDA, or on the CPU under TRITON_INTERPRET=1")]
if DEVICE == "cuda":
    pytestmark.append(pytest.mark.gpu)


@pytest.mark.parametrize("act", [ClampedSiLU(1.0), ClippedSwiGLU(1.0)], ids=["clamped_silu", "clipped_swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_activations_as_the_torch_loop(act, dtype):
    """gate | up ~ N(0, 9), so most values are past the limit 1.0: bf16 the same bits (every op rounded as the loop
    rounds it), fp32 within the down projection's reordered sum; the unclamped experts' output far from both."""
    g = torch.Generator().manual_seed(1)
    num_experts, hidden, inter, tokens, k = 4, 32, 24, 10, 2
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 3 / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, k, generator=g).to(DEVICE)
    fused = fused_experts_triton(x, w13, w2, ids, weights, act=act, fp32_weights=True)
    loop = fused_experts_torch(x, w13, w2, ids, weights, act=act, fp32_weights=True)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, loop)
    else:  # the gate | up and down sums in another order (hidden, then inter terms), the copies' sum of k
        tol = rounding_tol(magnitude(loop), terms=hidden + inter + k, steps=2)
        assert (fused - loop).abs().max().item() <= tol
    plain = fused_experts_torch(x, w13, w2, ids, weights, fp32_weights=True)
    assert (plain - loop).abs().max() > 0.1
