"""Checkpoints whose files name a supported model otherwise: EXAONE 3.x's and InternLM3's hub forms (their own
architecture names and config keys), Kimi K2's (model_type "kimi_k2", a remote-code config class the engine never
runs: read as DeepSeek-V3's), GPT-Neo's older files (their mask buffers). Each gives the logprobs of the form the
architecture tests check against transformers (test_engine_architectures.py), bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine_archs import MISSING, _hf
from helpers.gpt_family import cases
from helpers.hf_reference import trace_logprobs
from safetensors.torch import load_file, save_file

from replayllm import LLM

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)
_ALIASES = {"num_hidden_layers": "num_layers", "rms_norm_eps": "layer_norm_epsilon",
            "hidden_act": "activation_function"}


def _edit_config(path, edit) -> None:
    file = path / "config.json"
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))


def _logprobs(path) -> list[list[float]]:
    prompts, traces = cases()
    return trace_logprobs(LLM(str(path), **ENGINE), prompts, traces)


def test_exaone_hub_form_equals_transformers_form(tmp_path):
    """transformers saves EXAONE as "LlamaForCausalLM" (model_type "exaone") under the hub's tensor names; the hub's
    own config.json says "ExaoneForCausalLM" and uses the EXAONE key names: both load, to the same logprobs."""
    if "exaone" in MISSING:
        pytest.skip(MISSING["exaone"])
    _hf("exaone").save_pretrained(tmp_path / "saved")
    want = _logprobs(tmp_path / "saved")
    _hf("exaone").save_pretrained(tmp_path / "hub")

    def hub_form(cfg: dict) -> dict:
        cfg = {_ALIASES.get(k, k): v for k, v in cfg.items()}
        cfg["architectures"] = ["ExaoneForCausalLM"]
        return cfg

    _edit_config(tmp_path / "hub", hub_form)
    assert _logprobs(tmp_path / "hub") == want


def test_internlm3_hub_form_equals_transformers_form(tmp_path):
    """transformers saves InternLM3 as "LlamaForCausalLM" (model_type "internlm3"); the hub's config.json says
    "InternLM3ForCausalLM" and names the biases `qkv_bias` / `bias`: both load, to the same logprobs."""
    if "internlm3" in MISSING:
        pytest.skip(MISSING["internlm3"])
    _hf("internlm3").save_pretrained(tmp_path / "saved")
    want = _logprobs(tmp_path / "saved")
    _hf("internlm3").save_pretrained(tmp_path / "hub")
    renamed = {"attention_bias": "qkv_bias", "mlp_bias": "bias"}
    _edit_config(tmp_path / "hub", lambda cfg: {**{renamed.get(k, k): v for k, v in cfg.items()},
                                                "architectures": ["InternLM3ForCausalLM"]})
    assert _logprobs(tmp_path / "hub") == want


def test_kimi_k2_config_reads_as_deepseek_v3(tmp_path):
    """Kimi K2's config.json: model_type "kimi_k2" and an auto_map to its own configuration_deepseek.py (remote code,
    never run): read with DeepSeek-V3's config class, the same model."""
    _hf("deepseek_v3").save_pretrained(tmp_path)
    want = _logprobs(tmp_path)
    _edit_config(tmp_path, lambda cfg: {**cfg, "model_type": "kimi_k2", "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}})
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.architecture == "DeepseekV3ForCausalLM"
    prompts, traces = cases()
    assert trace_logprobs(llm, prompts, traces) == want


def test_gpt_neo_files_with_their_mask_buffers_load(tmp_path):
    """GPT-Neo's older files store each layer's causal / window mask (`attn.attention.bias`, `masked_bias`): not
    weights, skipped; the same logprobs as the file without them."""
    if "gpt_neo" in MISSING:
        pytest.skip(MISSING["gpt_neo"])
    _hf("gpt_neo").save_pretrained(tmp_path)
    want = _logprobs(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.0.attn.attention.bias"] = torch.ones(1, 1, 256, 256, dtype=torch.bool).tril()
    tensors["transformer.h.0.attn.attention.masked_bias"] = torch.tensor(-1e9)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert _logprobs(tmp_path) == want
