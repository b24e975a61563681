"""MiniMax-M2 (models/minimax_m2.py) beyond test_engine_architectures.py[minimax_m2] (logprobs against transformers,
weight updates, batch invariance): the hub's config form (`rotary_dim` without `partial_rotary_factor`, the MTP
modules' tensors in the checkpoint), a checkpoint without routing bias, the router against transformers' own, the
routes reported and replayed, and the forms refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.engine_archs import _hf
from helpers.gpt_family import cases
from helpers.hf_reference import max_gap_to_transformers, minimax_m2_reference_problem, trace_logprobs
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file

from replayllm import LLM
from replayllm.model_runner_v2.models.minimax_m2 import MiniMaxM2ForCausalLM, route_biased_sigmoid

modeling_minimax_m2 = pytest.importorskip("transformers.models.minimax_m2.modeling_minimax_m2",
                                          reason="this transformers has no MiniMax-M2 (the reference)")
pytestmark = pytest.mark.skipif(minimax_m2_reference_problem() is not None,
                                reason=str(minimax_m2_reference_problem()))
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _rewrite(path, config_edit=None, tensors_edit=None) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    if tensors_edit:
        save_file(tensors_edit(load_file(str(path / "model.safetensors"))), str(path / "model.safetensors"),
                  metadata={"format": "pt"})


def _hub_form(config: dict) -> dict:
    """config.json as MiniMaxAI's repositories ship it: rope_theta and rotary_dim at the top, no rope_parameters
    (so no partial_rotary_factor), the remote code's switches, three MTP modules."""
    config = {k: v for k, v in config.items() if k != "rope_parameters"}
    return {**config, "rope_theta": 5000000, "attn_type_list": [1] * config["num_hidden_layers"],
            "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_qk_norm": True, "use_routing_bias": True,
            "shared_intermediate_size": 0, "num_mtp_modules": 3, "mtp_transformer_layers": 1, "use_mtp": True}


def _with_mtp(tensors: dict) -> dict:
    """An MTP module's tensors after the last layer (model.layers.<num_hidden_layers>.*), as the hub's files hold."""
    extra = {f"model.layers.3.{k[len('model.layers.0.'):]}": v.clone() for k, v in tensors.items()
             if k.startswith("model.layers.0.")}
    return {**tensors, **extra, "model.layers.3.enorm.weight": torch.ones(64)}


def test_the_hub_form_scores_what_the_transformers_form_scores(tmp_path):
    """The same weights under the hub's config.json (rotary_dim 8 of head_dim 16 and no partial_rotary_factor: a
    model rotating whole heads would differ) and with MTP tensors in the file (skipped): the same logprobs, bit for
    bit, and both within rounding of transformers."""
    hf = _hf("minimax_m2")
    hf.save_pretrained(tmp_path / "a")
    prompts, traces = cases()
    want = trace_logprobs(LLM(str(tmp_path / "a"), **ENGINE), prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, want) <= LOGPROB_TOL
    hf.save_pretrained(tmp_path / "b")
    _rewrite(tmp_path / "b", _hub_form, _with_mtp)
    assert trace_logprobs(LLM(str(tmp_path / "b"), **ENGINE), prompts, traces) == want


def test_a_checkpoint_without_routing_bias(tmp_path):
    """use_routing_bias false and no e_score_correction_bias tensors: experts chosen on the sigmoid scores alone,
    as transformers' router with its buffer at zero."""
    hf = _hf("minimax_m2")
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    hf.save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda c: {**c, "use_routing_bias": False},
             lambda t: {k: v for k, v in t.items() if not k.endswith("e_score_correction_bias")})
    prompts, traces = cases()
    got = trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_is_transformers(dtype):
    """route_biased_sigmoid against MiniMaxM2TopKRouter on the same gate and bias (the bias wide enough to move
    the choice away from the plain top k): the same experts and the same weights, bit for bit."""
    config = transformers.MiniMaxM2Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=4)
    torch.manual_seed(0)
    router = modeling_minimax_m2.MiniMaxM2TopKRouter(config).to(dtype)
    torch.nn.init.normal_(router.weight, std=0.3)
    bias = (torch.rand(16) * 2 - 1).to(dtype)
    x = torch.randn(50, 32, dtype=dtype)
    _, hf_weights, hf_ids = router(x, bias)
    weights, ids = route_biased_sigmoid(F.linear(x, router.weight), bias, 4)
    assert not torch.equal(ids.sort(-1)[0], F.linear(x, router.weight).topk(4)[1].sort(-1)[0])  # the bias mattered
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    hf = _hf("minimax_m2")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 1, 2)
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(), sparse_layers=(0, 1, 2))


def test_forced_rows_keep_their_experts_weighted_by_their_own_scores():
    logits, bias = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)), torch.linspace(-0.5, 0.5, 8)
    own_w, own_ids = route_biased_sigmoid(logits, bias, 2)
    forced = torch.full((6, 2), -1, dtype=torch.int16)
    forced[3] = torch.tensor([7, 0])
    weights, ids = route_biased_sigmoid(logits, bias, 2, forced)
    assert ids[3].tolist() == [7, 0] and torch.equal(ids[:3], own_ids[:3]) and torch.equal(weights[4:], own_w[4:])
    scores = logits[3, [7, 0]].sigmoid()
    torch.testing.assert_close(weights[3], scores / scores.sum())


def test_rotary_dim_alone_gives_the_rotating_share():
    """A config read without transformers' conversion (no partial_rotary_factor anywhere; transformers' own config
    class derives it from rotary_dim, so the end-to-end test above cannot tell): the share is rotary_dim /
    head_dim, and without rotary_dim whole heads rotate."""
    hub = SimpleNamespace(rotary_dim=64, head_dim=128, hidden_size=3072, num_attention_heads=48)
    assert MiniMaxM2ForCausalLM.spec(hub).partial_rotary_factor == 0.5
    assert MiniMaxM2ForCausalLM.spec(SimpleNamespace(head_dim=128)).partial_rotary_factor == 1.0


@pytest.mark.parametrize("edit, message", [
    (dict(attn_type_list=[1, 0, 1]), "lightning-attention"),
    (dict(shared_intermediate_size=64), "shared expert"),
    (dict(qk_norm_type="per_head"), "qk_norm_type"),
    (dict(scoring_func="softmax"), "scoring_func"),
], ids=["lightning", "shared-expert", "per-head-norm", "softmax"])
def test_forms_it_does_not_run_are_refused(tmp_path, edit, message):
    _hf("minimax_m2").save_pretrained(tmp_path)
    _rewrite(tmp_path, lambda c: {**c, **edit})
    with pytest.raises(ValueError, match=f"this MiniMax-M2 config is not supported: .*{message}"):
        LLM(str(tmp_path), **ENGINE)
