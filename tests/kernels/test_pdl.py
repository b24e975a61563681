"""Programmatic dependent launch (kernels/pdl.py): when it is used, and, on the GPU, that every PDL kernel waits
for the kernel before it (a chain fed by slow kernels gives bitwise the results of the same chain without PDL,
eagerly and in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from replayllm.kernels import gemv, pdl
from replayllm.kernels.dispatch import env_flag
from replayllm.kernels.kv_cache_write import write_kv_cache_triton
from replayllm.kernels.paged_attention import paged_decode_attention_triton
from replayllm.kernels.rotary import qk_norm_rope_triton


@pytest.fixture
def pdl_switch(monkeypatch):
    """set(on): turn PDL on or off for the launches that follow (the decision is cached per device)."""
    def set_(on: bool) -> None:
        monkeypatch.setattr(pdl, "ENABLED", on)
        pdl.pdl_supported.cache_clear()

    yield set_
    pdl.pdl_supported.cache_clear()


def test_env_switch(monkeypatch):
    monkeypatch.setenv("REPLAYLLM_PDL", "0")
    assert not env_flag("REPLAYLLM_PDL")
    monkeypatch.setenv("REPLAYLLM_PDL", "1")
    assert env_flag("REPLAYLLM_PDL")
    monkeypatch.delenv("REPLAYLLM_PDL")
    assert env_flag("REPLAYLLM_PDL") and not env_flag("REPLAYLLM_PDL", default=False)  # unset: the default
    monkeypatch.setenv("REPLAYLLM_PDL", "yes")
    with pytest.raises(ValueError, match="REPLAYLLM_PDL must be 0 or 1"):
        env_flag("REPLAYLLM_PDL")


def test_no_pdl_off_cuda_or_when_switched_off(pdl_switch):
    """Never on CPU (the interpreter has no griddepcontrol) and never with the switch off; the launch options
    then set the kernels' PDL constexpr False and pass no Triton launch option."""
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert pdl.pdl_options(torch.device("cpu")) == {"PDL": False}
    pdl_switch(False)
    assert not pdl.pdl_supported(torch.device("cuda"))  # decided before any CUDA call
    assert pdl.pdl_options(torch.device("cuda")) == {"PDL": False}


def test_no_pdl_on_rocm(pdl_switch, monkeypatch):
    """A ROCm build reports "cuda" devices (an MI300 even capability 9.4): no PDL there."""
    pdl_switch(True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the interpreter alone would say no)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    pdl.pdl_supported.cache_clear()
    assert not pdl.pdl_supported(torch.device("cuda"))


# -- compiled, CUDA (marker `gpu`; bench/gpu_check.sh runs this file with TRITON_INTERPRET=0) ------------------

H, HKV, D, BLOCK, CONTEXT = 16, 8, 128, 16, 300


def _layer_inputs():
    g = torch.Generator(device="cuda").manual_seed(7)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)

    w = dict(big=rnd(4096, 4096, scale=1 / 64), gain=(1 + 0.1 * torch.randn(1024, generator=g, device="cuda")).to(bf),
             qkv=rnd((H + 2 * HKV) * D, 1024, scale=1 / 32), qn=rnd(D, scale=0.1) + 1, kn=rnd(D, scale=0.1) + 1,
             o_proj=rnd(1024, H * D, scale=1 / 45), gate_up=rnd(6144, 1024, scale=1 / 32),
             down=rnd(1024, 3072, scale=1 / 55))
    blocks = -(-(CONTEXT + 1) // BLOCK)
    kv = rnd(2, blocks + 1, BLOCK, HKV, D)
    tables = torch.arange(1, blocks + 1, dtype=torch.int32, device="cuda")[None]  # block 0 unused
    angles = torch.arange(4096, device="cuda")[:, None] / (10000 ** (torch.arange(D // 2, device="cuda") / (D // 2)))
    rope = dict(cos=angles.cos().float().contiguous(), sin=angles.sin().float().contiguous())
    state = dict(kv=kv, tables=tables, seq_lens=torch.tensor([CONTEXT + 1], device="cuda"),
                 positions=torch.tensor([CONTEXT], device="cuda"),
                 slot=torch.tensor([(CONTEXT // BLOCK + 1) * BLOCK + CONTEXT % BLOCK], device="cuda"))  # its table
    return w, rope, state, rnd(4096, 4096)


def _decoder_layer(a, w, rope, state):
    """A Qwen3 decoder layer's decode-step launches at batch 1, each fed by the one before, the first two by a
    ~0.1 ms GEMM (the window in which an early launch would read stale data). Returns (out, the KV cache)."""
    x = (a @ w["big"])[-1:, :1024].contiguous()
    qkv, residual = gemv.norm_gemv_triton(x, None, w["gain"], 1e-6, w["qkv"])
    q, k, v = qkv.view(1, H + 2 * HKV, D).split([H, HKV, HKV], dim=1)
    q, k = qk_norm_rope_triton(state["positions"], q, k, rope["cos"], rope["sin"], w["qn"], w["kn"])
    write_kv_cache_triton(state["kv"], k.view(1, HKV, D), v, state["slot"])
    o = paged_decode_attention_triton(q.view(1, H, D), state["kv"], state["seq_lens"], state["tables"], D**-0.5,
                                      CONTEXT + 1, num_splits=4)  # split: the reduce kernel runs too
    h = gemv.gemv_triton(o.reshape(1, H * D), w["o_proj"])
    h, residual = gemv.norm_gemv_triton(h, residual, w["gain"], 1e-6, w["gate_up"])
    return gemv.gemv_triton(h, w["down"], silu_mul=True) + residual, state["kv"].clone()


@pytest.mark.gpu
def test_pdl_kernels_wait_for_their_predecessors(pdl_switch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+ (Hopper's griddepcontrol); this GPU launches every kernel without it")
    pdl_switch(True)
    assert pdl.pdl_supported(torch.device("cuda")), "sm_90+ with this Triton must launch with PDL"
    w, rope, state, a = _layer_inputs()
    kv0 = state["kv"].clone()
    out, kv = _decoder_layer(a, w, rope, state)
    pdl_switch(False)
    state["kv"].copy_(kv0)
    plain, plain_kv = _decoder_layer(a, w, rope, state)
    assert torch.equal(out, plain) and torch.equal(kv, plain_kv)
    assert not torch.equal(kv, kv0)  # the step wrote its K/V

    pdl_switch(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _decoder_layer(a, w, rope, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_kv = _decoder_layer(a, w, rope, state)
    g = torch.Generator(device="cuda").manual_seed(11)
    for trial in range(3):
        a.copy_(torch.randn(4096, 4096, generator=g, device="cuda").to(torch.bfloat16))
        state["kv"].copy_(kv0)
        graph.replay()
        torch.cuda.synchronize()
        pdl_switch(False)
        state["kv"].copy_(kv0)
        want, want_kv = _decoder_layer(a, w, rope, state)
        pdl_switch(True)
        assert torch.equal(g_out, want) and torch.equal(g_kv, want_kv), trial
