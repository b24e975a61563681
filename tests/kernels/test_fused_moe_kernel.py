"""Fused MoE experts (kernels/fused_moe.py, kernels/moe_align.py): the Triton grouped GEMMs under the interpreter
against the plain-torch loop (moe.py's semantics), the device-side alignment, no host sync, bitwise batch
invariance; on CUDA (marker `gpu`): the compiled kernels, a CUDA-graph capture replayed with new inputs."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.tolerances import magnitude, rounding_tol

from replayllm.kernels.fused_moe import TILE_INTERPRET, fused_experts_torch, fused_experts_triton
from replayllm.kernels.moe_align import max_padded_blocks, moe_align

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The kernels on CPU tensors run only under the Triton interpreter (the GPU run compiles them: the `gpu` tests).
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0, device="cpu"):
    """w13 [E, 2I, H], w2 [E, H, I] with fan-in scaling (activations stay O(1))."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def _routes(num_tokens: int, num_experts: int, k: int, seed: int = 0, device="cpu", experts=None):
    """k distinct experts per token (as top-k gives), drawn from `experts` (default all), and fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(num_tokens)])
    w = torch.rand(num_tokens, k, generator=g)
    return ids.to(device), (w / w.sum(-1, keepdim=True)).to(device)


def _tol(x, w13, w2, ids, ref, relu2: bool = False, gelu_tanh: bool = False) -> float:
    """|kernel - reference| bound: two computations of the same values that differ only in summation order.
    fp32: scale = the largest value that gets rounded (gate/up and h of the copies actually routed, the output),
    length-max(H, I) dot products (terms), three rounding stages (gate/up, their product, the down projection).
    bf16/fp16: both sides round the same values to the dtype; an fp32 sum landing on the other side of a rounding
    boundary flips gate/up/h by one dtype rounding, which the down projection carries on, plus the output's own
    rounding (the routing weights are <= 1). relu2: w13 [E, I, H] the up rows alone, h = relu(up)^2; gelu_tanh:
    h = gelu_tanh(gate) * up."""
    gate_up = torch.einsum("th,enh->ten", x.double(), w13.double())  # [T, E, 2I]
    gate_up = gate_up[torch.arange(x.shape[0], device=x.device)[:, None], ids]  # the routed copies: [T, k, 2I]
    if relu2:
        h = F.relu(gate_up).square()
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        h = (F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)) * up
    if x.dtype == torch.float32:
        scale = max(magnitude(gate_up), magnitude(h), magnitude(ref.double()))
        return rounding_tol(scale, terms=max(x.shape[1], w2.shape[2]), steps=3)
    # Flipped roundings of h (signs at random) move the down projection's output element n of a copy by about
    # eps * sqrt(sum_i (w2[e, n, i] * h[i])^2): that L2 norm is the scale of the propagated term.
    sq = torch.einsum("tki,eni->tken", h.square(), w2.double().square())  # [T, k, E, H]
    l2 = sq.gather(2, ids[:, :, None, None].expand(-1, -1, 1, sq.shape[3])).sqrt()
    return rounding_tol(ref.double(), dtype=x.dtype) + rounding_tol(l2, steps=2, dtype=x.dtype)


def _check_close(x, w13, w2, ids, w) -> torch.Tensor:
    got = fused_experts_triton(x, w13, w2, ids, w)
    ref = fused_experts_torch(x, w13, w2, ids, w)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=_tol(x, w13, w2, ids, ref))
    return got


# -- alignment ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens,num_experts,k,block_m,experts", [
    (1, 4, 1, 16, None), (5, 8, 2, 4, None), (33, 8, 2, 16, [1, 6]), (33, 4, 1, 16, [2]), (20, 8, 2, 1, None),
])
def test_align_structure(num_tokens, num_experts, k, block_m, experts):
    ids, _ = _routes(num_tokens, num_experts, k, seed=num_tokens, experts=experts)
    al = moe_align(ids, num_experts, block_m)
    n = num_tokens * k
    max_blocks = max_padded_blocks(n, num_experts, block_m)
    assert al.sorted_ids.shape == (max_blocks * block_m,) and al.sorted_ids.dtype == torch.int32
    assert al.block_expert.shape == (max_blocks,) and al.num_rows.shape == (1,)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=num_experts)
    num_rows = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert int(al.num_rows) == num_rows and num_rows % block_m == 0
    used = al.sorted_ids[:num_rows]
    real = used[used < n].long()
    assert sorted(real.tolist()) == list(range(n))  # every copy exactly once
    assert (al.sorted_ids[num_rows:] == n).all() and (al.block_expert[num_rows // block_m :] == num_experts).all()
    for b in range(num_rows // block_m):
        rows = al.sorted_ids[b * block_m : (b + 1) * block_m].long()
        rows = rows[rows < n]
        assert len(rows) > 0  # padding never fills a whole block
        assert (flat[rows] == al.block_expert[b]).all()
    for e in range(num_experts):  # within an expert, copies keep their order t*k + j
        mine = real[flat[real] == e]
        assert torch.equal(mine, mine.sort().values)


# -- kernels vs the torch loop (interpreter) --------------------------------------------------------------------
@needs_interpreter
@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_matches_reference_fp32(num_tokens, k, num_experts):
    hidden, inter = 40, 24  # not multiples of the 16-wide tiles; 3 K tiles in GEMM1, 2 in GEMM2
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32)
    ids, w = _routes(num_tokens, num_experts, k, seed=7 * num_tokens + k)
    _check_close(x, w13, w2, ids, w)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype):
    torch.manual_seed(1)
    x = (torch.randn(33, 40) * 2).to(dtype)
    w13, w2 = _weights(8, 40, 24, dtype, seed=1)
    ids, w = _routes(33, 8, 2, seed=3)
    _check_close(x, w13, w2, ids, w)


@needs_interpreter
@pytest.mark.parametrize("experts,k", [([3], 1), ([3, 5], 2), ([0, 7], 1)])
def test_idle_experts_and_one_hot_expert(experts, k):
    """Experts that receive no token, all tokens on one expert (a group of 33 spans three 16-row blocks), and a
    token routed twice to one expert (duplicate ids: each copy still gets its own row)."""
    torch.manual_seed(2)
    x = torch.randn(33, 40)
    w13, w2 = _weights(8, 40, 24, torch.float32, seed=2)
    ids, w = _routes(33, 8, k, seed=4, experts=experts)
    _check_close(x, w13, w2, ids, w)
    dup = torch.full((5, 2), 6)
    _check_close(x[:5], w13, w2, dup, w[:5] if k == 2 else torch.rand(5, 2))


@needs_interpreter
def test_strided_x_int32_ids_and_odd_sizes():
    torch.manual_seed(3)
    base = torch.randn(5, 2 * 17)
    x = base[:, ::2]  # column stride 2: copied by the launcher
    w13, w2 = _weights(4, 17, 9, torch.float32, seed=3)
    ids, w = _routes(5, 4, 2, seed=5)
    _check_close(x, w13, w2, ids.to(torch.int32), w)


@needs_interpreter
def test_matches_stacked_experts():
    """The reference is `StackedExperts.forward` itself on the stacked parameters (same ops, same bits)."""
    from replayllm.model_runner_v2.models.moe import StackedExperts

    torch.manual_seed(4)
    num_experts, hidden, inter = 4, 40, 24
    mod = StackedExperts(num_experts, hidden, inter)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, seed=4)
    mod.gate_up_proj.data.copy_(w13.reshape(-1, hidden))
    mod.down_proj.data.copy_(w2.reshape(-1, inter))
    x = torch.randn(5, hidden)
    ids, w = _routes(5, num_experts, 2, seed=6)
    want = mod(x, ids, w)
    assert torch.equal(fused_experts_torch(x, w13, w2, ids, w), want)
    got = fused_experts_triton(x, mod.gate_up_proj.view(num_experts, 2 * inter, hidden),
                               mod.down_proj.view(num_experts, hidden, inter), ids, w)
    torch.testing.assert_close(got, want, rtol=0, atol=_tol(x, w13, w2, ids, want))


def test_empty_batch_and_bad_input():
    w13, w2 = _weights(4, 40, 24, torch.float32)
    out = fused_experts_triton(torch.randn(0, 40), w13, w2, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 40)
    x, (ids, w) = torch.randn(3, 40), _routes(3, 4, 2)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fused_experts_triton(x.double(), w13, w2, ids, w)
    with pytest.raises(ValueError, match="share one dtype"):
        fused_experts_triton(x, w13.half(), w2, ids, w)
    with pytest.raises(ValueError, match="inconsistent"):
        fused_experts_triton(x, w13, w2[:, :, :5], ids, w)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts_triton(x, w13, w2, ids.float(), w)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts_triton(x, w13, w2, ids, w[:, :1])


# -- no host sync, batch invariance ----------------------------------------------------------------------------
@needs_interpreter
def test_no_host_sync(monkeypatch):
    """fused_experts_triton never reads a device value on the host: .item(), .tolist(), nonzero, boolean-mask indexing
    and implicit bool()/int() conversions of tensors all raise while it runs (the kernels under the interpreter)."""
    torch.manual_seed(5)
    x = torch.randn(5, 40)
    w13, w2 = _weights(4, 40, 24, torch.float32, seed=5)
    ids, w = _routes(5, 4, 2, seed=8)
    ref = fused_experts_torch(x, w13, w2, ids, w)

    def forbidden(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")
        return fail

    orig_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            raise AssertionError("host sync: boolean-mask indexing")
        return orig_getitem(self, index)

    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "masked_select"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    for name in ("nonzero", "masked_select", "bincount", "unique"):
        monkeypatch.setattr(torch, name, forbidden(f"torch.{name}"))
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    got = fused_experts_triton(x, w13, w2, ids, w)
    with pytest.raises(AssertionError, match="host sync"):  # the check has teeth: the torch loop syncs
        fused_experts_torch(x, w13, w2, ids, w)
    monkeypatch.undo()
    torch.testing.assert_close(got, ref, rtol=0, atol=_tol(x, w13, w2, ids, ref))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_result_is_batch_invariant(dtype):
    """A token's output is bitwise the same alone, in a batch of 33, or in a shifted sub-batch (other tokens on its
    experts, other positions inside the expert blocks)."""
    torch.manual_seed(6)
    x = torch.randn(33, 40).to(dtype)
    w13, w2 = _weights(4, 40, 24, dtype, seed=6)
    ids, w = _routes(33, 4, 2, seed=9)
    full = fused_experts_triton(x, w13, w2, ids, w)
    for t in (0, 17, 32):
        one = fused_experts_triton(x[t : t + 1], w13, w2, ids[t : t + 1], w[t : t + 1])
        assert torch.equal(one, full[t : t + 1]), t
    assert torch.equal(fused_experts_triton(x[5:22], w13, w2, ids[5:22], w[5:22]), full[5:22])


def test_interpreter_tile_is_small():
    """Guard the test file's runtime: the interpreter pays per program, so its tile stays 16-wide."""
    assert TILE_INTERPRET.block_m == 16 and TILE_INTERPRET.block_n == 16


def _check_activation(act: str, dtype: torch.dtype, device: str) -> None:
    """NemotronH's ungated ReLU² experts (w13 [E, I, H]: the up rows alone) or Gemma 4's GeGLU ones (the kernel's
    GELU as g * sigmoid(2y)): the kernel against the torch loop (torch.square(F.relu(up)) / F.gelu's tanh form),
    in fp32 also the loop against the formula (ReLU²) or against SiLU's (GeGLU: another activation), and each token
    alone as in the batch."""
    num_tokens, num_experts, k, hidden, inter = 13, 6, 2, 48, 40
    g = torch.Generator().manual_seed(21)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=21, device=device)
    if act == "relu2":
        w13 = w13[:, :inter].contiguous()
    ids, w = _routes(num_tokens, num_experts, k, seed=22, device=device)
    flag = {act: True}
    got = fused_experts_triton(x, w13, w2, ids, w, **flag)
    ref = fused_experts_torch(x, w13, w2, ids, w, **flag)
    tol = _tol(x, w13, w2, ids, ref, **flag)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=tol)
    if dtype == torch.float32 and act == "relu2":
        up = torch.einsum("th,tkih->tki", x.double(), w13.double()[ids])
        formula = torch.einsum("tki,tkhi->tkh", F.relu(up).square(), w2.double()[ids])
        torch.testing.assert_close(ref.double(), (formula * w.double()[..., None]).sum(1), rtol=0, atol=tol)
    elif dtype == torch.float32:
        assert (fused_experts_torch(x, w13, w2, ids, w) - ref).abs().max() > 10 * tol
    alone = torch.cat([fused_experts_triton(x[t : t + 1], w13, w2, ids[t : t + 1], w[t : t + 1], **flag)
                       for t in (0, 6, 12)])
    assert torch.equal(alone, got[[0, 6, 12]])
    if act == "relu2":
        with pytest.raises(ValueError, match="inconsistent shapes"):  # a gated [E, 2I, H] w13 is not relu2's
            fused_experts_triton(x, torch.cat([w13, w13], 1), w2, ids, w, relu2=True)


@needs_interpreter
@pytest.mark.parametrize("act", ["relu2", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_and_geglu_experts(act, dtype):
    _check_activation(act, dtype, "cpu")


# -- CUDA (compiled) -------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("act", ["relu2", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_and_geglu_experts_compiled(act, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the compiled kernel)")
    _check_activation(act, dtype, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_matches_reference_on_cuda(dtype):
    num_tokens, num_experts, k, hidden, inter = 300, 16, 4, 256, 192
    g = torch.Generator().manual_seed(10)
    x = (torch.randn(num_tokens, hidden, generator=g) * 2).to("cuda", dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=10, device="cuda")
    ids, w = _routes(num_tokens, num_experts, k, seed=11, device="cuda")
    ids[:40] = torch.tensor([2, 3, 5, 7], device="cuda")  # a crowded group; expert 0..1 may stay idle
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside fused_experts_triton raises
    try:
        got = fused_experts_triton(x, w13, w2, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = fused_experts_torch(x, w13, w2, ids, w)
    tol = _tol(x, w13, w2, ids, ref)
    diff = (got.float() - ref.float()).abs().max().item()
    print(f"{dtype}: max |fused - torch| = {diff:.3g} (tol {tol:.3g}), "
          f"bitwise equal {(got == ref).float().mean().item():.4f}")
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=tol)
    alone = torch.cat([fused_experts_triton(x[t : t + 1], w13, w2, ids[t : t + 1], w[t : t + 1])
                       for t in (0, 150, 299)])
    assert torch.equal(alone, got[[0, 150, 299]]), "a token's result depends on its batch on this GPU"


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """fused_experts_triton captured once in a CUDA graph, replayed with new x / routes / weights of the same T."""
    num_tokens, num_experts, k, hidden, inter, dtype = 64, 16, 4, 256, 192, torch.bfloat16
    w13, w2 = _weights(num_experts, hidden, inter, dtype, seed=12, device="cuda")
    static_x = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    static_ids, static_w = _routes(num_tokens, num_experts, k, seed=13, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) off the capture
        fused_experts_triton(static_x, w13, w2, static_ids, static_w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts_triton(static_x, w13, w2, static_ids, static_w)
    for seed, experts in ((14, None), (15, [1, 9]), (16, [4])):
        x = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
        ids, w = _routes(num_tokens, num_experts, min(k, len(experts or range(num_experts))), seed=seed,
                         device="cuda", experts=experts)
        if ids.shape[1] < k:  # fewer distinct experts than k: repeat ids (duplicates are allowed)
            ids = ids.repeat(1, k)[:, :k]
            w = torch.rand(num_tokens, k, device="cuda")
        static_x.copy_(x)
        static_ids.copy_(ids)
        static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_experts_torch(x, w13, w2, ids, w)
        torch.testing.assert_close(static_out.float(), ref.float(), rtol=0, atol=_tol(x, w13, w2, ids, ref))
