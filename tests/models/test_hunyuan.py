"""HunYuan (models/hunyuan.py) beyond test_engine_architectures.py[hunyuan_dense, hunyuan_moe] (logprobs against
transformers, the fused rope-then-norm kernels, weight updates, batch invariance, TP=2): the NTK-alpha rope's
frequencies against transformers', the fp32 router bit for bit in bf16, routes replayed, and the forms refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.engine_archs import ARCHS, MISSING, SMALL, _hf
from helpers.moe_routes import assert_routes_match_transformers_and_replay

from replayllm import LLM
from replayllm.rope_settings import RopeSettings

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _config(arch: str, **over):
    if arch in MISSING:
        pytest.skip(MISSING[arch])
    config_cls, _, extra = ARCHS[arch]
    return config_cls(**{**SMALL, **extra, **over})


def test_the_alpha_rope_is_transformers_frequencies():
    """"dynamic" with a fixed alpha: theta * alpha ** (d / (d - 2)) as the base, static (transformers'
    compute_ntk_alpha_rope_parameters), bit for bit; another model's "dynamic" is dynamic NTK (test_rope_scaling)."""
    modeling = pytest.importorskip("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense")
    config = _config("hunyuan_dense")
    settings = RopeSettings.from_hf_config(config)
    assert settings.rope_type == "ntk_alpha" and settings.alpha == 1000.0
    theirs = modeling.HunYuanDenseV1RotaryEmbedding(config).inv_freq
    assert torch.equal(settings.inv_freq(16), theirs)
    assert not torch.equal(RopeSettings(theta=10000.0).inv_freq(16), theirs)
    llama = transformers.LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                               "factor": 2.0})
    assert RopeSettings.from_hf_config(llama).rope_type == "dynamic"


def test_the_router_is_transformers_in_bf16(tmp_path):
    """The fp32 router over the fp32 token (its weight loaded without rounding to bf16), softmax, top-k,
    renormalised: the same experts and weights as transformers' HunYuanMoEV1Gate in a bf16 model."""
    modeling = pytest.importorskip("transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe")
    hf = _hf("hunyuan_moe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **{**ENGINE, "dtype": "bfloat16"})
    ours = llm.llm_engine.runner.model.model.layers[1].mlp
    theirs = modeling.HunYuanMoEV1Gate(hf.config, layer_idx=1)
    theirs.load_state_dict(hf.model.layers[1].mlp.gate.state_dict())
    assert ours.gate.weight.dtype == torch.float32 and torch.equal(ours.gate.weight, theirs.wg.weight)
    x = torch.randn(24, 64).to(torch.bfloat16)
    _, weights, ids = theirs(x)
    got_weights, got_ids = ours.route_tokens(x, None)
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    hf = _hf("hunyuan_moe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 1, 2)
    assert llm.llm_engine.model_config.num_experts_per_tok == 2
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(), sparse_layers=(0, 1, 2))


@pytest.mark.parametrize("over, message", [
    (dict(moe_topk=[2, 1, 2]), r"num_experts_per_tok=\[2, 1, 2\] differs between layers"),
    (dict(use_cla=True), "cross-layer attention"),
    (dict(num_shared_expert=[2, 2, 2]), "num_shared_expert=2 is not supported"),
])
def test_forms_transformers_does_not_build_alike_are_refused(tmp_path, over, message):
    config = _config("hunyuan_moe")
    transformers.HunYuanMoEV1ForCausalLM(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(over)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), **ENGINE)
