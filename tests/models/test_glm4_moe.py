"""GLM-4-MoE (models/glm4_moe.py) beyond test_engine_architectures.py's checks (logprobs against transformers, weight
updates, batch invariance, TP=2): its grouped sigmoid router against transformers' own, the routes the engine
reports and replays, the router kept in fp32 in a bf16 model, and the multi-token-prediction layer skipped."""

from __future__ import annotations

import pytest
import torch
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from safetensors.torch import load_file, save_file
from test_engine_architectures import ENGINE, _hf

from replayllm import LLM
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.models.glm4_moe import route_grouped_sigmoid


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    hf = _hf("glm4_moe")
    path = tmp_path_factory.mktemp("glm4_moe")
    hf.save_pretrained(str(path))
    return path, hf


def test_the_router_is_transformers_router(glm):
    """route_grouped_sigmoid against transformers' Glm4MoeTopkRouter on the same logits: the same experts (as sets:
    both take topk unsorted) and weights; forced rows keep their ids, weighted by their own scores."""
    _, hf = glm
    router = hf.model.layers[1].mlp.gate
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, ids = router(x)
    cfg = hf.config
    ours_w, ours_ids = route_grouped_sigmoid(logits, router.e_score_correction_bias, cfg.num_experts_per_tok,
                                             cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    order, theirs = ours_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ours_ids.gather(1, order), ids.gather(1, theirs))
    torch.testing.assert_close(ours_w.gather(1, order), weights.gather(1, theirs))
    # The best group only: every chosen expert of a row lies in one group of 4.
    assert ((ours_ids // 4) == (ours_ids[:, :1] // 4)).all()
    forced = torch.full((40, 2), -1, dtype=torch.int16)
    forced[5] = torch.tensor([7, 0])
    fw, fids = route_grouped_sigmoid(logits, router.e_score_correction_bias, 2, cfg.n_group, cfg.topk_group,
                                     True, 2.5, forced)
    assert fids[5].tolist() == [7, 0] and torch.equal(fids[:5], ours_ids[:5])
    scores = logits[5, [7, 0]].sigmoid()
    torch.testing.assert_close(fw[5], scores / scores.sum() * 2.5)


def test_routes_match_transformers_and_replay_bit_for_bit(glm):
    path, hf = glm
    llm = LLM(str(path), **ENGINE, enable_return_routed_experts=True)
    mc = llm.llm_engine.model_config
    assert mc.moe_layers == (1, 2) and mc.num_experts == 8
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(0,), sparse_layers=(1, 2))


def test_a_bf16_model_keeps_the_router_in_fp32_and_skips_the_mtp_layer(glm, tmp_path):
    """A checkpoint with an fp32 router (as GLM-4.5's) and a multi-token-prediction layer (model.layers.<L>.*):
    the bf16 model's router holds the stored fp32 values exactly, and the extra layer is not an unknown tensor."""
    path, hf = glm
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).symlink_to(f)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # the MTP layer: index L = 3
    save_file(tensors, str(tmp_path / "model.safetensors"))
    mc = ModelConfig.from_pretrained(str(tmp_path), dtype="bfloat16")
    model = load_model(mc, torch.device("cpu"))
    bias = tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert not torch.equal(bias.bfloat16().float(), bias)  # what a bf16 rounding would change

    def router_is_the_checkpoints(gate) -> None:
        assert gate.weight.dtype == torch.float32
        assert torch.equal(gate.e_score_correction_bias.cpu(), bias)  # (the engine's on CUDA in the GPU run)
        assert torch.equal(gate.weight.cpu(), tensors["model.layers.2.mlp.gate.weight"])

    router_is_the_checkpoints(model.model.layers[2].mlp.gate)
    assert model.model.layers[2].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    # update_weights_from_disk reads the checkpoint the same way
    llm = LLM(str(tmp_path), **{**ENGINE, "dtype": "bfloat16"})
    gate = llm.llm_engine.runner.model.model.layers[2].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
    assert llm.llm_engine.update_weights_from_disk(str(tmp_path)) > 0
    router_is_the_checkpoints(gate)
