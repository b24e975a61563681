"""GPT-BigCode (models/gpt_bigcode.py: StarCoder, SantaCoder, WizardCoder, Granite Code 20B / 34B) beyond
test_engine_architectures.py[gpt_bigcode] (multi-query: logprobs against transformers, weight updates, batch
invariance): one K/V head per query head (`multi_query` false: the fused c_attn grouped per head), the config
options, a transformers 4.x config.json (no num_key_value_heads), and a contradicting one refused."""

from __future__ import annotations

import json

import pytest
import transformers
from helpers.gpt_family import cases, save_random_model
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM

SIZES = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=96, initializer_range=0.5,
             bos_token_id=1, eos_token_id=2)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _bigcode(path, **extra):
    return save_random_model(transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig(**SIZES, **extra), path)


@pytest.mark.parametrize("extra", [dict(multi_query=False),
                                   dict(scale_attn_weights=False, activation_function="gelu")],
                         ids=["one-kv-head-per-query-head", "unscaled-gelu"])
def test_the_config_options_score_what_transformers_scores(tmp_path, extra):
    hf = _bigcode(tmp_path, **extra)
    llm = LLM(str(tmp_path), **ENGINE)
    kv_heads = llm.llm_engine.model_config.num_kv_heads
    assert kv_heads == (4 if extra.get("multi_query") is False else 1)  # the cache holds as many K/V heads
    prompts, traces = cases()
    assert max_gap_to_transformers(hf, prompts, traces, trace_logprobs(llm, prompts, traces)) <= LOGPROB_TOL


def test_a_config_without_num_key_value_heads_is_multi_query(tmp_path):
    """transformers 4.x wrote no num_key_value_heads (its config derived none): `multi_query` alone says one K/V
    head; the engine reads the same model from either form. A num_key_value_heads that contradicts multi_query is
    refused (the cache would be sized wrong)."""
    hf = _bigcode(tmp_path)
    prompts, traces = cases()
    current = trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("num_key_value_heads", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.num_kv_heads == 1
    assert trace_logprobs(llm, prompts, traces) == current
    assert max_gap_to_transformers(hf, prompts, traces, current) <= LOGPROB_TOL
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_key_value_heads=4)))
    with pytest.raises(ValueError, match="multi_query=True has 1 key/value head"):
        LLM(str(tmp_path), **ENGINE)
