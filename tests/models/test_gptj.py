"""GPT-J (models/gptj.py) beyond test_engine_architectures.py[gptj] (logprobs against transformers, weight updates,
batch invariance): LayerNorms away from weight 1 / bias 0, a rotary over part of each head and over all of it,
older files' attention-mask and sin/cos buffers skipped, an odd rotary_dim refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.gpt_family import cases, save_random_model
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file

from replayllm import LLM

SIZES = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128, n_inner=96, initializer_range=0.5,
             bos_token_id=1, eos_token_id=2)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _gptj(path, **extra):
    return save_random_model(transformers.GPTJForCausalLM, transformers.GPTJConfig(**SIZES, **extra), path)


@pytest.mark.parametrize("rotary_dim", [8, 16], ids=["half-of-each-head", "whole-head"])
def test_engine_scores_what_transformers_scores(tmp_path, rotary_dim):
    hf = _gptj(tmp_path, rotary_dim=rotary_dim)
    prompts, traces = cases()
    got = trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL


def test_older_files_buffers_are_skipped_and_an_odd_rotary_dim_is_refused(tmp_path):
    """EleutherAI/gpt-j-6b's files carry `h.N.attn.bias` / `attn.masked_bias` (the causal mask); newer ones may carry
    the sin/cos table: none of them is a weight, and the model loads the same. A rotary_dim that cannot form rotary
    pairs within a head is refused (transformers 5 refuses a null one itself)."""
    _gptj(tmp_path / "current", rotary_dim=8)
    tensors = load_file(str(tmp_path / "current" / "model.safetensors"))
    for i in range(SIZES["n_layer"]):
        tensors[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        tensors[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e9)
    tensors["transformer.rotary_emb.embed_positions"] = torch.zeros(128, 8)
    (tmp_path / "older").mkdir()
    save_file(tensors, str(tmp_path / "older" / "model.safetensors"))
    (tmp_path / "older" / "config.json").write_text((tmp_path / "current" / "config.json").read_text())
    prompts, traces = cases()
    runs = [trace_logprobs(LLM(str(tmp_path / d), **ENGINE), prompts, traces) for d in ("current", "older")]
    assert runs[0] == runs[1]
    config = json.loads((tmp_path / "older" / "config.json").read_text())
    (tmp_path / "older" / "config.json").write_text(json.dumps(dict(config, rotary_dim=7)))
    with pytest.raises(ValueError, match="rotary_dim=7 must be even and within a head of 16"):
        LLM(str(tmp_path / "older"), **ENGINE)
