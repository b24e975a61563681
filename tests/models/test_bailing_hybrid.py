"""Ling 3 (BailingHybrid) beyond test_engine_architectures.py's and test_hybrid_models.py's comparisons: the clipped
SwiGLU of its experts (kernels/activation.ClippedSwiGLU) against transformers' modules in bf16 (the fused MoE
kernel's branch: tests/kernels/test_fused_moe_clamps.py), its hub checkpoint with the multi-token-prediction layer
the engine skips, and the config options it refuses."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from helpers.engine_archs import ENGINE, MISSING, _hf
from safetensors.torch import load_file, save_file

from replayllm import LLM, SamplingParams
from replayllm.kernels.activation import clipped_swiglu_torch
from replayllm.model_runner_v2.models.bailing_hybrid import BailingHybridForCausalLM

pytestmark = pytest.mark.skipif("bailing_hybrid" in MISSING, reason=MISSING.get("bailing_hybrid", ""))


def _config(**kw):
    return transformers.BailingHybridConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        layer_group_size=2, num_local_experts=8, n_group=2, topk_group=1, moe_intermediate_size=32,
        first_k_dense_replace=1, **kw)


def test_clipped_swiglu_is_transformers_in_bf16():
    """The routed experts' activation (transformers' BailingHybridExperts._apply_gate) and the shared experts'
    (BailingHybridMLP with its layer's limit), bit for bit in bf16, on values the clamps cross."""
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf

    config = _config(swiglu_limits=[0, 1.5, 0, 0], swiglu_limits_shared=[0, 0.75, 0, 0])
    experts = hf.BailingHybridExperts(config, layer_idx=1)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(64, 64, generator=g) * 3).bfloat16()  # [T, 2I], I = 32
    ours = clipped_swiglu_torch(gate_up, 1.5)
    assert torch.equal(ours, experts._apply_gate(gate_up))
    assert not torch.equal(ours, torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:])  # the clamps bite
    shared = hf.BailingHybridMLP(config, intermediate_size=32, layer_idx=1).bfloat16()
    x = torch.randn(16, 64, generator=g).bfloat16()
    with torch.no_grad():
        gate, up = shared.gate_proj(x), shared.up_proj(x)
        assert torch.equal(shared.down_proj(clipped_swiglu_torch(torch.cat([gate, up], -1), 0.75)), shared(x))
    invariant = clipped_swiglu_torch(gate_up.float(), 1.5, invariant=True)  # the row-invariant SiLU: within ulps
    assert torch.allclose(invariant, clipped_swiglu_torch(gate_up.float(), 1.5), rtol=1e-6, atol=1e-6)


def test_the_hub_checkpoint_with_its_mtp_layer(tmp_path):
    """transformers saves the hub's names (word_embeddings, attention.*, dense, q/k/v_conv1d, f_proj / dt_bias /
    A_log under the attention, experts per expert, gate.expert_bias); the released files add a multi-token-prediction
    layer after the decoder (model.layers.<num_hidden_layers>.*), which the engine skips: the same logprobs."""
    hf = _hf("bailing_hybrid")
    hf.save_pretrained(tmp_path)
    saved = load_file(f"{tmp_path}/model.safetensors")
    for name in ("model.word_embeddings.weight", "model.layers.0.attention.q_conv1d.weight",
                 "model.layers.0.attention.f_proj.weight", "model.layers.0.attention.A_log",
                 "model.layers.1.attention.dense.weight", "model.layers.1.mlp.gate.expert_bias",
                 "model.layers.1.mlp.experts.7.up_proj.weight"):
        assert name in saved, name
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompt = [{"prompt_token_ids": [5, 17, 99, 4, 250, 31, 8]}]

    def run():
        out = LLM(str(tmp_path), **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs]

    before = run()
    layer = hf.config.num_hidden_layers  # an MTP layer: a copy of layer 1 (MLA, sparse) under the next index
    mtp = {re.sub(r"^model\.layers\.1\.", f"model.layers.{layer}.", k): v.clone() for k, v in saved.items()
           if k.startswith("model.layers.1.")}
    save_file({**saved, **mtp, f"model.layers.{layer}.enorm.weight": torch.ones(64)},
              f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    assert run() == before


@pytest.mark.parametrize("overrides, says", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mlp_layer_types=["dense", "sparse", "moe", "sparse"]), "mlp_layer_types"),
])
def test_options_it_cannot_honour_are_refused(overrides, says):
    config = _config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=says):
        BailingHybridForCausalLM(config)
