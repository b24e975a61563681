"""GPT-OSS's experts in the fused MoE kernels (kernels/fused_moe.py: biases on gate | up and down, the clamped
SwiGLU): against a plain-torch transcription of transformers' GptOssExperts on its own interleaved, transposed layout
(turned into ours by models/gpt_oss.py's loader rules), and against the plain-torch loop; under the interpreter on
CPU, compiled on CUDA (`gpu`). transformers' module itself: where the installed release routes with [T, k] weights
(5.x; 4.5x took [T, E] scores)."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
import transformers
from helpers.hf_reference import gpt_oss_reference_problem
from helpers.tolerances import magnitude, rounding_tol

from replayllm.kernels.activation import ClampedSwiGLU, clamped_swiglu_torch
from replayllm.kernels.fused_moe import fused_experts_torch, fused_experts_triton
from replayllm.model_runner_v2.models.gpt_oss import deinterleave

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)
ACT = ClampedSwiGLU(alpha=1.702, limit=2.5)  # a limit the gate and up values cross (both clamps bite)


def _hf_experts(num_experts: int, hidden: int, inter: int, seed: int):
    """transformers' GptOssExperts with random weights and biases (fan-in scaled, gate/up values around +-3)."""
    cfg = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts,
                                    swiglu_limit=ACT.limit, swiglu_alpha=ACT.alpha,
                                    experts_implementation="eager")  # the loop that defines the model
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(num_experts, hidden, 2 * inter, generator=g) * 3 / hidden**0.5)
        experts.gate_up_proj_bias.copy_(torch.randn(num_experts, 2 * inter, generator=g) * 0.5)
        experts.down_proj.copy_(torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5)
        experts.down_proj_bias.copy_(torch.randn(num_experts, hidden, generator=g) * 0.5)
    return experts.eval()


def _transcribed(experts, x, ids, w) -> torch.Tensor:
    """transformers' GptOssExperts.forward, op for op on its parameters (gate at even columns, up at odd ones)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate_up = x[t] @ experts.gate_up_proj[e].to(x.dtype) + experts.gate_up_proj_bias[e].to(x.dtype)
            gate = gate_up[0::2].clamp(max=ACT.limit)
            up = gate_up[1::2].clamp(min=-ACT.limit, max=ACT.limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * ACT.alpha))
            y = h @ experts.down_proj[e].to(x.dtype) + experts.down_proj_bias[e].to(x.dtype)
            out[t] += y * w[t, j].to(x.dtype)
    return out


def _ours(experts, dtype, device="cpu"):
    """(w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I], b13 [E, 2I], b2 [E, H]): the loader's layout."""
    return (deinterleave(experts.gate_up_proj.detach()).transpose(1, 2).contiguous().to(device, dtype),
            experts.down_proj.detach().transpose(1, 2).contiguous().to(device, dtype),
            deinterleave(experts.gate_up_proj_bias.detach()).to(device, dtype),
            experts.down_proj_bias.detach().to(device, dtype))


def _routes(num_tokens: int, num_experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    return ids, torch.rand(num_tokens, k, generator=g).softmax(-1)


def _tol(x, w13, w2, b13, ids, ref) -> float:
    """fp32: rounding at the largest value rounded (gate/up, h, the output) over max(H, I)-long sums and five
    rounding stages (gate/up, bias, activation, down, bias). bf16/fp16: a flipped rounding of h carried through the
    down projection (its L2 norm per output), plus the output's own rounding, as test_fused_moe_kernel._tol."""
    gate_up = torch.einsum("th,enh->ten", x.double(), w13.double()) + b13.double()  # [T, E, 2I]
    gate_up = gate_up[torch.arange(x.shape[0])[:, None], ids.cpu()]  # [T, k, 2I]
    h = clamped_swiglu_torch(gate_up, ACT)
    if x.dtype == torch.float32:
        scale = max(magnitude(gate_up), magnitude(h), magnitude(ref.double()))
        return rounding_tol(scale, terms=max(x.shape[1], w2.shape[2]), steps=5)
    sq = torch.einsum("tki,eni->tken", h.square(), w2.double().cpu().square())
    l2 = sq.gather(2, ids.cpu()[:, :, None, None].expand(-1, -1, 1, sq.shape[3])).sqrt()
    return rounding_tol(ref.double(), dtype=x.dtype) + rounding_tol(l2, steps=3, dtype=x.dtype)


def _compare(num_tokens: int, dtype: torch.dtype, device: str, seed: int) -> None:
    num_experts, k, hidden, inter = 4, 2, 40, 24  # odd tiles: 3 K tiles in GEMM1, 2 in GEMM2 under the interpreter
    experts = _hf_experts(num_experts, hidden, inter, seed)
    x32 = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    ids, w = _routes(num_tokens, num_experts, k, seed + 2)
    w13, w2, b13, b2 = _ours(experts, dtype, device)
    x = x32.to(device, dtype)
    got = fused_experts_triton(x, w13, w2, ids.to(device), w.to(device), b13=b13, b2=b2, act=ACT).cpu()
    loop = fused_experts_torch(x, w13, w2, ids.to(device), w.to(device), b13=b13, b2=b2, act=ACT).cpu()
    with torch.no_grad():
        hf = _transcribed(experts, x.cpu(), ids, w)

    # The clamps bite: some gate and up values of the routed copies lie beyond the limit.
    gate_up = torch.einsum("th,enh->ten", x32, w13.float().cpu()) + b13.float().cpu()
    assert (gate_up[torch.arange(num_tokens)[:, None], ids].abs() > ACT.limit).float().mean() > 0.05
    tol = _tol(x.cpu(), w13.cpu(), w2.cpu(), b13.cpu(), ids, hf)
    # transformers' module itself where it routes with [T, k] weights and agrees with its own loop (5.17's does not:
    # helpers/hf_reference.py); the kernels are held to the transcription either way.
    problem = gpt_oss_reference_problem()
    if problem:  # said, not silently left out
        warnings.warn(f"transformers' GptOssExperts itself not compared: {problem}", stacklevel=1)
    if "top_k_pos" in inspect.getsource(type(experts).forward) and problem is None:
        with torch.no_grad():
            module = experts.to(dtype)(x.cpu(), router_indices=ids, routing_weights=w.to(dtype))
        torch.testing.assert_close(module.float(), hf.float(), rtol=0, atol=tol)
    torch.testing.assert_close(got.float(), hf.float(), rtol=0, atol=tol)
    torch.testing.assert_close(loop.float(), hf.float(), rtol=0, atol=tol)
    if dtype == torch.float32:  # SiLU instead of the clamped SwiGLU is another function: the check can fail
        plain = fused_experts_triton(x, w13, w2, ids.to(device), w.to(device), b13=b13, b2=b2).cpu()
        assert (plain.float() - hf.float()).abs().max() > 100 * tol


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 21])
def test_kernels_match_transformers_gpt_oss_experts(num_tokens, dtype):
    _compare(num_tokens, dtype, "cpu", seed=num_tokens)


def test_bias_shapes_are_checked():
    experts = _hf_experts(4, 40, 24, 0)
    w13, w2, b13, b2 = _ours(experts, torch.float32)
    ids, w = _routes(3, 4, 2, 0)
    with pytest.raises(ValueError, match="b13 must be"):
        fused_experts_torch(torch.randn(3, 40), w13, w2, ids, w, b13=b13[:, :-1], b2=b2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_match_transformers_gpt_oss_experts(dtype):
    _compare(300, dtype, "cuda", seed=5)
