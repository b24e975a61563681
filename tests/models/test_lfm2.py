"""LFM2 and LFM2-MoE (models/lfm2.py) beyond test_engine_architectures.py[lfm2, lfm2_moe] (logprobs against
transformers, weight updates, batch invariance, TP=2) and test_hybrid_models.py (the same bits however the tokens
are cut into steps, sleep mode): the short convolution's state without a recurrent matrix, the hub's config keys,
the feed-forward width rule, and LFM2-MoE's routes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.engine_archs import ENGINE, MISSING, _hf
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.models.lfm2 import ShortConv, lfm2_ff_width
from replayllm.model_runner_v2.recurrent_state import state_bytes


def _needs(arch: str) -> None:
    if arch in MISSING:
        pytest.skip(MISSING[arch])


def test_the_convolution_history_is_the_whole_state(tmp_path):
    """Each conv layer keeps its last conv_L_cache - 1 = 2 inputs (B * x, 64 channels) per slot and no recurrent
    matrix; the KV cache is the attention layer's alone."""
    _needs("lfm2")
    _hf("lfm2").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=4, **ENGINE)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.model_config.recurrent_layers == (0, 2) and len(runner.kv_caches) == 1
    convs = [m for m in runner.model.modules() if isinstance(m, ShortConv)]
    assert [tuple(c.conv_state.shape) for c in convs] == [(5, 2, 64)] * 2 and all(c.state is None for c in convs)
    assert state_bytes(llm.llm_engine.config) == 2 * 5 * 2 * 64 * 4  # fp32 model: 4 bytes an element
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_feed_forward_width_rule():
    """transformers' Lfm2MLP: int(2 I / 3), times the multiplier, rounded up to block_multiple_of; as is when the
    config turns the adjustment off."""
    def width(i, **kw):
        return lfm2_ff_width(SimpleNamespace(intermediate_size=i, **kw))

    adjust = dict(block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256)
    assert width(12288, **adjust) == 8192  # LFM2-1.2B's block_ff_dim
    assert width(6656, **adjust) == 4608  # 4437 rounded up
    assert width(10752, block_auto_adjust_ff_dim=False) == 10752
    assert width(96, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.3, block_multiple_of=32) == 96


def test_the_hub_config_keys(tmp_path):
    """The released configs' spelling: block_ff_dim (the width before the adjustment), full_attn_idxs (the
    attention layers; the others conv), tie_embedding, block_norm_eps beside norm_eps: the engine builds transformers'
    model from them (its logprobs) with the width transformers' module has."""
    _needs("lfm2")
    torch.manual_seed(0)
    config = transformers.Lfm2Config(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        block_ff_dim=192, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        full_attn_idxs=[2], conv_L_cache=4, tie_embedding=True, norm_eps=1e-5, block_norm_eps=1e-3,
        max_position_embeddings=256)
    hf = transformers.Lfm2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.recurrent_layers == (0, 1)
    mlp = llm.llm_engine.runner.model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.shape[0] == 2 * hf.model.layers[0].feed_forward.w1.weight.shape[0] == 2 * 128
    prompt = [7, 8, 9, 10, 11]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, logprobs=0,
                                                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(6), out.token_ids]
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    assert (engine - ref).abs().max().item() <= LOGPROB_TOL


def test_moe_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    """LFM2-MoE: layer 0 dense (-1 routes), layers 1 and 2 the top 2 of sigmoid scores + the expert bias."""
    _needs("lfm2_moe")
    hf = _hf("lfm2_moe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (1, 2)
    assert_routes_match_transformers_and_replay(
        llm, hf, dense_layers=(0,), sparse_layers=(1, 2),
        router=lambda m, i: (m.model.layers[i].feed_forward.gate, lambda out: out[2]))
