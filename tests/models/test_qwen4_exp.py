"""Qwen4-Exp beyond test_engine_architectures.py's checks (logprobs against transformers' stepwise forward, weight
updates, batch invariance, tensor parallelism) and test_hybrid_models.py's (the same bits across chunked prefill,
fast replay and preemption): QSA's dense limit against transformers' own sparse selection, the context capped there,
the multimodal checkpoint and the hub's stacked experts serving the same language model, and the config options it
refuses."""

from __future__ import annotations

import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.engine_archs import MISSING
from safetensors.torch import load_file, save_file
from test_engine_architectures import ENGINE
from test_hybrid_models import _replay
from test_recent_archs import _hf

from replayllm import LLM
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.models.qwen4_exp import check_qwen4_exp_config

# every test here reads transformers' qwen4_exp classes (the GPU machine's older release lacks them)
pytestmark = pytest.mark.skipif("qwen4_exp" in MISSING, reason=MISSING.get("qwen4_exp", ""))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("qwen4_exp"))
    _hf("qwen4_exp").save_pretrained(path)
    return path


def test_qsa_attends_to_every_key_below_budget_plus_ratio():
    """transformers' QSA with a budget of 8 in blocks of 4 gives the dense model's logits (the same weights, a budget
    of 128; within fp32 rounding: SDPA's blocks see other rows' masks) while a query sees at most 8 + 4 - 1 = 11
    tokens, and far other logits from the 12th on: the limit moe_facts.sparse_attention_limit serves up to."""
    dense = _hf("qwen4_exp")
    config = copy.deepcopy(dense.config)
    config.indexer_budget = 8
    sparse = transformers.Qwen4ExpForCausalLM(config).eval()
    sparse.load_state_dict(dense.state_dict())
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = dense(ids).logits[0], sparse(ids).logits[0]
    gap = (a - b).abs().amax(-1)  # [24]
    assert gap[:11].max() < 1e-5 and gap[11] > 0.1


def test_context_capped_at_the_dense_limit(saved):
    """budget 128 + ratio 4 - 1 = 131: the default max_model_len (the config's limit is 256), a longer one refused."""
    config = EngineConfig(model=saved, device="cpu", skip_tokenizer_init=True)
    assert config.model_config.dense_attention_limit == 131 and config.max_model_len == 131
    assert config.model_config.recurrent_layers == (0, 2) and config.model_config.moe_layers == (0, 1, 2)
    with pytest.raises(ValueError, match=r"indexer_budget \+ indexer_compress_ratio - 1=131"):
        EngineConfig(model=saved, device="cpu", skip_tokenizer_init=True, max_model_len=132)


def test_multimodal_checkpoint_and_stacked_experts(saved, tmp_path):
    """Qwen4ExpForConditionalGeneration's checkpoint (`model.language_model.*` beside a vision tower) and the hub's
    stacked experts ([E, 2I, H] / [E, H, I], Qwen3.5-MoE's form) serve the text checkpoint's logprobs, bit for bit."""
    text = transformers.AutoModelForCausalLM.from_pretrained(saved)
    vl_config = transformers.Qwen4ExpConfig(
        text_config=text.config.to_dict(), tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           num_position_embeddings=16))
    vl = transformers.Qwen4ExpForConditionalGeneration(vl_config).eval()
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(tmp_path / "vl")
    names = load_file(tmp_path / "vl" / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in names)
    assert any(".self_attn.indexer." in k for k in names)  # in the file, not loaded (dense up to the limit)
    ref = _replay(LLM(saved, **ENGINE))
    assert _replay(LLM(str(tmp_path / "vl"), **ENGINE)) == ref

    tensors = load_file(f"{saved}/model.safetensors")
    stacked = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]])
                   for e in range(8)]
        stacked[f"{p}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        stacked[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    (tmp_path / "moe").mkdir()
    save_file(stacked, tmp_path / "moe" / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(f"{saved}/config.json", tmp_path / "moe" / "config.json")
    assert _replay(LLM(str(tmp_path / "moe"), **ENGINE)) == ref


def test_per_layer_embedding_refused_at_load(saved, tmp_path):
    """PLE layers (their per-request n-gram token history and dilated-convolution history): a clear error at load."""
    for name in ("model.safetensors", "config.json"):
        shutil.copy(f"{saved}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "ple_layer_ids": [1]}))
    with pytest.raises(ValueError, match="ple_layer_ids=\\[1\\]"):
        LLM(str(tmp_path), **ENGINE)


@pytest.mark.parametrize("change, match", [(dict(hc_count=1), "hc_count=1"),
                                           (dict(output_gate_type="gelu"), "output_gate_type='gelu'")])
def test_options_transformers_rejects_are_refused_too(change, match):
    """One stream, an output gate transformers does not know (its config class refuses both; the engine reads a
    config.json without transformers where the installed one lacks the class): refused by the model too."""
    config = _hf("qwen4_exp").config.to_dict()
    with pytest.raises(ValueError, match=match):
        check_qwen4_exp_config(SimpleNamespace(**{**config, **change}))
