"""HY-V4 (Tencent's Hy4) beyond test_engine_architectures.py's checks (logprobs against transformers, weight updates
from its in-memory names, batch invariance, tensor parallelism): the hub checkpoint form with hyper-connections
whose mixing weights matter (transformers' initial scale of 0.01 leaves them near-constant), the hyper-connection
modules against transformers' in bf16 bit for bit, the experts' clamped SiLU in the fused MoE kernel, and the
config options it refuses."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from helpers.engine_archs import MISSING
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file
from test_engine_architectures import ENGINE
from test_recent_archs import _hf, _score

from replayllm import LLM
from replayllm.config import EngineConfig
from replayllm.kernels.activation import ClampedSiLU
from replayllm.kernels.fused_moe import fused_experts_torch, fused_experts_triton
from replayllm.model_runner_v2.models.hyper_connection import HyperConnection, HyperHead

# every test here reads transformers' hy_v4 classes (the GPU machine's older release lacks them)
pytestmark = pytest.mark.skipif("hy_v4" in MISSING, reason=MISSING.get("hy_v4", ""))


def _stirred(seed: int = 0):
    """engine_archs' small HY-V4 with every hyper-connection's scale and base drawn wide (pre and post then range
    over most of their sigmoid), so a stream mixed or spread wrongly moves the logprobs far."""
    hf = _hf("hy_v4")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("_hc.scale", "hc_head.hc_scale")):
                param.copy_(torch.rand(param.shape, generator=g) * 0.2 + 0.05)
            elif name.endswith(("_hc.base", "hc_head.hc_base")):
                param.copy_(torch.rand(param.shape, generator=g) * 2 - 1)
    return hf


def test_hy_v4_hub_form_with_stirred_hyper_connections(tmp_path):
    """transformers saves HY-V4 under the hub's names (`hc_pre.hc_attn_layer.hc_fn`, `hc_pre.hc_head.hc_head_fn`,
    `learnable_sink_param`, `linear_gate` for every gate_proj): the engine reads them and scores what transformers
    scores, with the streams' weights far from constant; the context capped at index_topk."""
    hf = _stirred()
    hf.save_pretrained(str(tmp_path))
    names = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.1.hc_pre.hc_attn_layer.hc_fn", "model.layers.2.hc_pre.hc_mlp_layer.hc_scale",
                 "model.hc_pre.hc_head.hc_head_base", "model.layers.0.self_attn.learnable_sink_param",
                 "model.layers.0.self_attn.linear_gate.weight", "model.layers.0.mlp.linear_gate.weight",
                 "model.layers.1.mlp.shared_experts.linear_gate.weight"):
        assert name in names, name
    assert json.loads((tmp_path / "config.json").read_text())["indexer_types"] == ["full", "full", "shared"]
    with pytest.raises(ValueError, match="index_topk=128"):
        EngineConfig(model=str(tmp_path), device="cpu", skip_tokenizer_init=True, max_model_len=129)
    llm = LLM(str(tmp_path), **ENGINE)
    for prompt, trace in (([5, 9, 17, 40, 41, 42, 43], [3, 7, 11, 13, 19]), (list(range(3, 60)), [8, 6, 4])):
        assert _score(llm, hf, prompt, trace) <= LOGPROB_TOL


def _hc_config(hidden: int = 64, streams: int = 4):
    return transformers.HYV4Config(hidden_size=hidden, hc_mult=streams, hc_magnitude=1.5, hc_eps=1e-6,
                                   rms_norm_eps=1e-5, num_hidden_layers=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hyper_connection_is_transformers_bit_for_bit(dtype):
    """HyperConnection (pre, post, the collapse and the residual add) and HyperHead against transformers' HY-V4
    modules on the same bf16 / fp32 streams: every step in fp32, rounded once, as transformers computes them."""
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection, HYV4HyperHead

    cfg, g = _hc_config(), torch.Generator().manual_seed(1)
    theirs, head = HYV4HyperConnection(cfg), HYV4HyperHead(cfg)
    ours = HyperConnection(64, 4, 1e-5, 1e-6, 1.5)
    our_head = HyperHead(64, 4, 1e-5, 1e-6)
    with torch.no_grad():
        for module, mine in ((theirs, ours), (head, our_head)):
            for name, param in module.named_parameters():
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
                getattr(mine, name).copy_(param)
    streams = (torch.randn(2, 5, 4, 64, generator=g) * 3).to(dtype)  # [B, S, N, H]
    out = torch.randn(2, 5, 64, generator=g).to(dtype)  # a block's output
    flat_streams, flat_out = streams.flatten(0, 1), out.flatten(0, 1)  # the engine's [T, N, H], [T, H]
    with torch.no_grad():
        post, x = theirs(streams)
        ours_x, ours_post = ours(flat_streams)
        assert ours_x.dtype == dtype and ours_post.dtype == torch.float32
        assert torch.equal(ours_x, x.flatten(0, 1)) and torch.equal(ours_post, post.flatten(0, 1))
        added = (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + streams.float()).to(dtype)  # their layer's
        assert torch.equal(HyperConnection.expand(flat_streams, ours_post, flat_out), added.flatten(0, 1))
        assert torch.equal(our_head(flat_streams), head(streams).flatten(0, 1))


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernel: compiled on CUDA, or on the CPU under TRITON_INTERPRET=1")
def test_fused_experts_clamp_silu_inputs_as_transformers():
    """The fused MoE kernel with ClampedSiLU (SiLU(min(gate, 1.5)) * clamp(up, +-1.5), values well past the limit)
    against transformers' HYV4Experts' loop on the same weights (their [E, 2I, H] / [E, H, I] layout is ours), in
    fp32; compiled on CUDA where there is one."""
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4Experts

    cfg = transformers.HYV4Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4, swiglu_limit=1.5,
                                  experts_implementation="eager")
    experts, g = HYV4Experts(cfg), torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 32, 32, generator=g) * 3 / 32**0.5)
        experts.down_proj.copy_(torch.randn(4, 32, 16, generator=g) / 16**0.5)
        x = torch.randn(9, 32, generator=g)
        ids = torch.randint(0, 4, (9, 2), generator=g)
        w = torch.rand(9, 2, generator=g)
        expected = experts(x, ids, w)
        args = (x, experts.gate_up_proj.detach(), experts.down_proj.detach(), ids, w)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        fused = fused_experts_triton(*(a.to(device) for a in args), act=ClampedSiLU(1.5), fp32_weights=True).cpu()
        loop = fused_experts_torch(*args, act=ClampedSiLU(1.5), fp32_weights=True)
        unclamped = fused_experts_torch(*args, fp32_weights=True)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loop, expected, rtol=1e-5, atol=1e-5)
    assert (unclamped - expected).abs().max() > 1e-2  # the clamps bite


@pytest.mark.parametrize("override, match", [
    (dict(layer_types=["indexed_attention", "sliding_attention", "indexed_attention"]), "HY-V4: layer_types"),
    (dict(indexer_types=["shared", "full", "full"]), "HY-V4: indexer_types"),
    (dict(indexer_types=["full", "full", "dense"]), "HY-V4: indexer_types"),
    (dict(hc_mult=0), "hc_mult >= 1"),
])
def test_hy_v4_refuses_what_it_cannot_honour(tmp_path, override, match):
    """A config.json the engine cannot serve as written: a clear ValueError at load, not a silent other model."""
    _hf("hy_v4").save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **override}))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **ENGINE)
