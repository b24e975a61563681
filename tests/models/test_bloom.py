"""BLOOM (models/bloom.py) beyond test_engine_architectures.py[bloom] (logprobs against transformers, weight
updates, batch invariance, TP=2): a head count that is not a power of two (the slopes' second series), the original
BigScience files' names (no `transformer.` prefix), the refused options, and the position limit of a config that
names none (ALiBi has no position table), against transformers."""

from __future__ import annotations

import json

import pytest
import transformers
from helpers.gpt_family import cases, save_original_form, save_random_model
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM
from replayllm.config import ModelConfig

SIZES = dict(vocab_size=300, hidden_size=72, n_layer=3, n_head=6, layer_norm_epsilon=1e-5, initializer_range=0.5,
             bos_token_id=1, eos_token_id=2)  # 6 heads of 12: slopes 1/4, 1/16, 1/64, 1/256, then 1/2, 1/8
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _bloom(path, **extra):
    return save_random_model(transformers.BloomForCausalLM, transformers.BloomConfig(**SIZES, **extra), path)


def test_six_heads_and_the_original_files_score_what_transformers_scores(tmp_path):
    """bigscience/bloom-560m's safetensors: `h.0.self_attention.query_key_value.weight` (no `transformer.` prefix),
    no lm_head.weight (tied); both forms, the same logprobs, transformers' within rounding."""
    hf = _bloom(tmp_path / "current")

    def rename(tensors):
        assert "transformer.word_embeddings_layernorm.weight" in tensors
        return {n.removeprefix("transformer."): t for n, t in tensors.items() if n != "lm_head.weight"}

    save_original_form(tmp_path / "current", tmp_path / "original", rename)
    prompts, traces = cases()
    runs = [trace_logprobs(LLM(str(tmp_path / d), **ENGINE), prompts, traces) for d in ("current", "original")]
    assert runs[0] == runs[1]
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


@pytest.mark.parametrize("extra, message", [
    (dict(apply_residual_connection_post_layernorm=True), "apply_residual_connection_post_layernorm"),
    (dict(slow_but_exact=True, pretraining_tp=2), "slow_but_exact"),
], ids=["post-layernorm-residual", "slow-but-exact"])
def test_forms_it_does_not_run_are_refused(tmp_path, extra, message):
    _bloom(tmp_path, **extra)
    with pytest.raises(ValueError, match=f"this BLOOM checkpoint is not supported: .*{message}"):
        LLM(str(tmp_path), **ENGINE)


@pytest.mark.parametrize("stated, limit", [({}, 2048), ({"seq_length": 4096}, 4096),
                                           ({"max_position_embeddings": 512}, 512)], ids=["none", "seq", "max"])
def test_the_position_limit_of_a_config_without_one(tmp_path, stated, limit):
    """BLOOM's configs name no max_position_embeddings: the first of vLLM's other keys, else vLLM's 2048, is the
    engine's limit (its default max_model_len)."""
    _bloom(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("max_position_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, **stated}))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.max_position_embeddings == limit
    assert getattr(mc.hf_config, "max_position_embeddings", None) == stated.get("max_position_embeddings")  # read only
    # the engine builds and takes the limit as its default max_model_len
    llm = LLM(str(tmp_path), **{k: v for k, v in ENGINE.items() if k != "max_model_len"})
    assert llm.llm_engine.config.max_model_len == limit
