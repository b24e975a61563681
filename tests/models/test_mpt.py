"""MPT (models/mpt.py) beyond test_engine_architectures.py[mpt] (logprobs against transformers, weight updates, batch
invariance): six heads (MPT's interleaved slopes), `clip_qkv` and `softmax_scale`, the hub checkpoints' name
`MPTForCausalLM`, the refused forms, and the slopes against transformers' own."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.gpt_family import cases, save_random_model
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL
from transformers.models.mpt import modeling_mpt

from replayllm import LLM
from replayllm.model_runner_v2.models.mpt import mpt_alibi_slopes

SIZES = dict(vocab_size=300, d_model=72, n_layers=3, n_heads=6, layer_norm_epsilon=1e-5, initializer_range=0.5,
             bos_token_id=1, eos_token_id=2, max_seq_len=256)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _mpt(path, **extra):
    return save_random_model(transformers.MptForCausalLM, transformers.MptConfig(**SIZES, **extra), path)


def test_six_heads_clipped_and_scaled_score_what_transformers_scores(tmp_path):
    """MPT's slopes for 6 heads (8's series, every other one first), q/k/v clamped at 0.5 and a softmax scale of
    0.2; then the same files under the hub's architecture name, MPTForCausalLM: the same logprobs."""
    hf = _mpt(tmp_path, attn_config={"clip_qkv": 0.5, "softmax_scale": 0.2})
    prompts, traces = cases()
    got = trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MPTForCausalLM"]}))
    assert trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces) == got


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 32, 48, 64])
def test_slopes_are_transformers(heads):
    """transformers adds slope * (key - last position) over its max_seq_len: the key one before the last gives
    -slope (MPT-7B 32 heads, MPT-30B 56 (padded to 64), 48 and odd counts)."""
    alibi = modeling_mpt.build_mpt_alibi_tensor(heads, 4)  # [heads, 1, 4]
    assert torch.equal(mpt_alibi_slopes(heads), -alibi[:, 0, -2])


@pytest.mark.parametrize("extra, message", [
    (dict(attn_config={"alibi": False}), "learned positions"),
    (dict(attn_config={"qk_ln": True}), "qk_ln"),
    (dict(no_bias=False), "no_bias"),
    (dict(expansion_ratio=2), "expansion_ratio"),
], ids=["no-alibi", "qk-ln", "biases", "expansion"])
def test_forms_it_does_not_run_are_refused(tmp_path, extra, message):
    _mpt(tmp_path, **extra)
    with pytest.raises(ValueError, match=f"this MPT checkpoint is not supported: .*{message}"):
        LLM(str(tmp_path), **ENGINE)
