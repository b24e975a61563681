"""A.X-K2 (SK Telecom) beyond test_engine_architectures.py's checks (logprobs against transformers, weight updates
from its in-memory names, batch invariance, tensor parallelism, --localize) and test_recent_archs.py's fp8 form: its
hub checkpoint form and config.json, and its grouped router's 0.0 for the dropped groups."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file
from test_engine_architectures import ENGINE
from test_recent_archs import _hf, _score

from replayllm import LLM
from replayllm.config import EngineConfig, ModelConfig
from replayllm.model_runner_v2.loader import load_model


def test_axk2_hub_form(tmp_path):
    """A.X-K2's checkpoint as transformers saves it (its conversion mapping reversed: the hub's `q_b_proj` for
    q_gate_proj, the gated norms' `W_down` / `W_up` for fc1 / fc2, per-expert tensors; the dense layer 0's second
    norm plain), config.json with the legacy `first_k_dense_replace` instead of `mlp_layer_types` and a
    `rope_interleave` false that transformers' A.X-K2 never reads: scores what transformers scores; the context capped
    at index_topk as DeepSeek-V3.2's."""
    hf = _hf("axk2")
    hf.save_pretrained(str(tmp_path))
    names = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.0.input_layernorm.W_down.weight",
                 "model.layers.1.post_attention_layernorm.W_up.weight",
                 "model.layers.0.post_attention_layernorm.weight", "model.layers.2.mlp.experts.7.down_proj.weight"):
        assert name in names
    config = json.loads((tmp_path / "config.json").read_text())
    del config["mlp_layer_types"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1, "rope_interleave": False}))
    model_config = ModelConfig.from_pretrained(str(tmp_path))
    assert model_config.moe_layers == (1, 2) and model_config.dense_attention_limit == 128
    with pytest.raises(ValueError, match="index_topk=128"):
        EngineConfig(model=str(tmp_path), device="cpu", skip_tokenizer_init=True, max_model_len=129)
    assert _score(LLM(str(tmp_path), **ENGINE), hf, [5, 9, 17, 40, 41, 42, 43], [3, 7, 11, 13, 19]) <= LOGPROB_TOL


def test_axk2_router_scores_experts_outside_the_chosen_groups_zero(tmp_path):
    """A.X-K2's grouped router fills the dropped groups' choice scores with 0.0 (DeepSeek-V3's with -inf): with every
    correction but expert 0's at -1, group 0 wins and its other experts score below the dropped ones, so each token's
    second expert comes from group 1, as in transformers."""
    hf = _hf("axk2-groups")
    bias = torch.full((8,), -1.0)
    bias[0] = 1.0
    hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
    hf.save_pretrained(str(tmp_path))
    block = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.device("cpu")).model.layers[1].mlp
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    _, hf_weights, hf_ids = hf.model.layers[1].mlp.gate(x)
    weights, ids = block.route_tokens(x, None)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order)) and (ids >= 4).any(dim=-1).all()
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=0)


def test_axk2_gated_norm_is_transformers_in_bf16(tmp_path):
    """A bf16 gated norm (fc1, silu and fc2 in bf16, the sigmoid and the product in fp32, one rounding), a dense
    layer's input norm and a sparse layer's second one, on the same rows as transformers': bit for bit."""
    model = _hf("axk2")
    model.save_pretrained(str(tmp_path))
    hf = type(model).from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    ours = load_model(ModelConfig.from_pretrained(str(tmp_path), dtype="bfloat16"), torch.device("cpu")).model.layers
    x = (torch.randn(9, 64, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    with torch.no_grad():
        for i, name in ((0, "input_layernorm"), (1, "post_attention_layernorm")):
            theirs = getattr(hf.model.layers[i], name)(x)
            assert torch.equal(getattr(ours[i], name)(x), theirs)
