"""Phi-3.5-MoE (models/phimoe.py) beyond test_engine_architectures.py[phimoe] (logprobs against transformers, weight
updates, batch invariance): SparseMixer's routing against transformers' bit for bit in bf16, replayed routes weighed
alike, routes reported and replayed end to end, longrope's mscales, the forms refused."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_archs import ARCHS, MISSING, SMALL, _hf
from helpers.gpt_family import cases
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM
from replayllm.model_runner_v2.models.phimoe import route_sparsemixer
from replayllm.rope_settings import RopeSettings

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _config(**over):
    if "phimoe" in MISSING:
        pytest.skip(MISSING["phimoe"])
    config_cls, _, extra = ARCHS["phimoe"]
    return config_cls(**{**SMALL, **extra, **over})


@pytest.mark.parametrize("eps", [0.01, 0.3])
def test_sparsemixer_is_transformers_in_bf16(eps):
    """route_sparsemixer == transformers' sparsemixer(training=False), weights and ids, on bf16 logits with near-ties
    and wide gaps; forcing its own ids changes nothing (routing replay's weights come from the same rule)."""
    modeling = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, 16, generator=g) * torch.tensor([0.05, 1.0, 3.0, 8.0]).repeat_interleave(16)[:, None]
              ).to(torch.bfloat16)
    want_w, want_ids = modeling.sparsemixer(logits, jitter_eps=eps, training=False, top_k=2)
    got_w, got_ids = route_sparsemixer(logits, eps)
    assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    again_w, again_ids = route_sparsemixer(logits, eps, forced=got_ids.to(torch.int16))
    assert torch.equal(again_ids, got_ids) and torch.equal(again_w, got_w)
    forced = torch.full_like(got_ids, -1, dtype=torch.int16)
    forced[::2] = torch.tensor([3, 5], dtype=torch.int16)  # half the rows replay experts 3 then 5
    w, ids = route_sparsemixer(logits, eps, forced=forced)
    assert (ids[::2] == torch.tensor([3, 5])).all() and torch.equal(ids[1::2], got_ids[1::2])
    assert torch.equal(w[1::2], got_w[1::2])


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    hf = _hf("phimoe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert_routes_match_transformers_and_replay(
        llm, hf, dense_layers=(), sparse_layers=(0, 1, 2),
        router=lambda m, i: (m.model.layers[i].mlp.router, lambda out: out[2]))


def test_longrope_mscales_follow_the_factor_list():
    """short_mscale with the short factors, long_mscale with the long ones (the served context decides: vLLM's rule;
    transformers' Phimoe rotary always takes the short factors, and the mscale by the sequence's length)."""
    settings = RopeSettings.from_hf_config(_config())
    assert settings.attention_factor == 1.2
    assert settings.for_context(128).attention_factor == 1.2
    long = settings.for_context(129)
    assert long.use_long_factor and long.attention_factor == 1.35


def test_two_experts_or_refused(tmp_path):
    config = _config(num_experts_per_tok=1)
    ARCHS["phimoe"][1](config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_experts_per_tok=1 is not supported"):
        LLM(str(tmp_path), **ENGINE)


def test_the_window_slides_as_transformers(tmp_path):
    """`sliding_window` (Phi-3.5-MoE's config names one): transformers' Phimoe masks with it; so does the engine (the
    20- and 50-token prompts outgrow a window of 8), and without it the logprobs move away."""
    config = _config(sliding_window=8)
    torch.manual_seed(0)
    hf = ARCHS["phimoe"][1](config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.sliding_window == 8
    prompts, traces = cases()
    got = trace_logprobs(llm, prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL
    hf.config.sliding_window = None  # transformers without the window: other logprobs (the window is applied)
    assert max_gap_to_transformers(hf, prompts, traces, got) > 10 * LOGPROB_TOL
