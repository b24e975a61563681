"""HRM-Text's checkpoint and config forms beyond test_engine_architectures' (its logprobs against transformers, weight
updates from a transformers module, batch invariance, TP=2): an older config.json (the per-stack layer count, a
num_key_value_heads transformers ignores, a top-level rope_theta), the KV cache it sizes, and the options refused."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engine_archs import MISSING, _hf
from helpers.hf_reference import teacher_forced
from helpers.tolerances import LOGPROB_TOL
from test_engine_architectures import ENGINE

from replayllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def hrm(tmp_path_factory):
    if "hrm_text" in MISSING:
        pytest.skip(MISSING["hrm_text"])
    hf = _hf("hrm_text")
    path = tmp_path_factory.mktemp("hrm")
    hf.save_pretrained(str(path))
    return path, hf


def test_an_older_config_loads_the_same_model(hrm, tmp_path):
    """The released file's form: num_hidden_layers per stack (2 here, 16 slots), two KV heads named (multi-head
    whatever it says), the theta at the top level. 16 KV layers of 4 heads, and transformers' logprobs."""
    path, hf = hrm
    config = json.loads((path / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    config.pop("num_layers_per_stack")
    config.update(num_hidden_layers=2, num_key_value_heads=2, rope_theta=theta)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), **ENGINE)
    mc = llm.llm_engine.model_config
    assert (mc.num_layers, mc.num_kv_heads) == (16, 4)
    prompt, trace = [5, 17, 33, 250, 8, 91], [9, 41, 77, 120, 3]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    lp, tokens = teacher_forced(hf, prompt, out.token_ids)
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def test_fp32_lm_head_is_refused_in_bf16(hrm):
    path, _ = hrm
    with pytest.raises(ValueError, match="enable_fp32_lm_head is not supported"):
        LLM(str(path), **dict(ENGINE, dtype="bfloat16", enable_fp32_lm_head=True))
