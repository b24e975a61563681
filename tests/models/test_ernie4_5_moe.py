"""Ernie 4.5 MoE (models/ernie4_5_moe.py) beyond test_engine_architectures.py[ernie4_5_moe] (logprobs against
transformers, weight updates, batch invariance): the router against transformers' Ernie4_5_MoeTopKRouter bit for bit in
bf16, and routes reported and replayed."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_archs import ARCHS, MISSING, SMALL, _hf
from helpers.moe_routes import assert_routes_match_transformers_and_replay

from replayllm import LLM
from replayllm.model_runner_v2.models.ernie4_5_moe import route_corrected_softmax

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _needs() -> None:
    if "ernie4_5_moe" in MISSING:
        pytest.skip(MISSING["ernie4_5_moe"])


def test_the_router_is_transformers_in_bf16():
    """fp32 logits of the bf16 token, softmax, top-k of softmax + correction, weights renormalised (clamped sum),
    rounded to bf16 at the experts: the same ids and weights as transformers' router."""
    _needs()
    modeling = pytest.importorskip("transformers.models.ernie4_5_moe.modeling_ernie4_5_moe")
    config_cls, _, extra = ARCHS["ernie4_5_moe"]
    theirs = modeling.Ernie4_5_MoeTopKRouter(config_cls(**{**SMALL, **extra}))
    with torch.no_grad():
        theirs.weight.normal_(std=0.5)
        theirs.moe_statics.e_score_correction_bias.uniform_(-0.05, 0.05)
    x = torch.randn(40, 64).to(torch.bfloat16)
    _, want_w, want_ids = theirs(x)
    logits = torch.nn.functional.linear(x.float(), theirs.weight.float())
    got_w, got_ids = route_corrected_softmax(logits, theirs.moe_statics.e_score_correction_bias[0], 2, 1e-12)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w.to(torch.bfloat16), want_w)


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    _needs()
    hf = _hf("ernie4_5_moe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (1, 2)
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(0,), sparse_layers=(1, 2))
