"""GPT-2 (models/gpt2.py) beyond test_engine_architectures.py[gpt2] (logprobs against transformers, weight updates,
batch invariance, TP=2): the original gpt2 files' form (no `transformer.` prefix, the attention-mask buffers
stored, no lm_head), the attention-scale options and the activation, against transformers."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.gpt_family import cases, save_original_form, save_random_model
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM

SIZES = dict(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=128, n_inner=96, initializer_range=0.5,
             bos_token_id=1, eos_token_id=2)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _gpt2(path, **extra):
    return save_random_model(transformers.GPT2LMHeadModel, transformers.GPT2Config(**SIZES, **extra), path)


@pytest.mark.parametrize("extra", [dict(scale_attn_by_inverse_layer_idx=True, activation_function="gelu"),
                                   dict(scale_attn_weights=False)], ids=["inverse-layer-scale-gelu", "unscaled"])
def test_the_config_options_score_what_transformers_scores(tmp_path, extra):
    hf = _gpt2(tmp_path, **extra)
    prompts, traces = cases()
    assert max_gap_to_transformers(hf, prompts, traces, trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts,
                                                                      traces)) <= LOGPROB_TOL


def test_the_original_files_form_loads_the_same_model(tmp_path):
    """openai-community/gpt2's safetensors: `h.0.attn.c_attn.weight` (no `transformer.` prefix), `h.N.attn.bias`
    mask buffers, no lm_head.weight (tied)."""
    hf = _gpt2(tmp_path / "current")

    def rename(tensors):
        original = {n.removeprefix("transformer."): t for n, t in tensors.items() if n != "lm_head.weight"}
        for i in range(SIZES["n_layer"]):
            original[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
            original[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        return original

    save_original_form(tmp_path / "current", tmp_path / "original", rename)
    prompts, traces = cases()
    runs = [trace_logprobs(LLM(str(tmp_path / d), **ENGINE), prompts, traces) for d in ("current", "original")]
    assert runs[0] == runs[1]
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


def test_an_activation_it_does_not_implement_is_refused(tmp_path):
    _gpt2(tmp_path, activation_function="relu")
    with pytest.raises(ValueError, match="activation_function 'relu' is not supported for GPT-2"):
        LLM(str(tmp_path), **ENGINE)
