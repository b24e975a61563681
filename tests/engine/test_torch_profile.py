"""LLM.start_profile / stop_profile (vLLM's; entrypoints/torch_profile.py): a Chrome trace of what the engine ran in
between, in the folder the environment names; clear errors without it and out of order."""

from __future__ import annotations

import json
import os

import pytest

from replayllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny16):
    return LLM(tiny16, device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_a_profile_traces_the_engines_steps(llm, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "vllm"))  # vLLM's name works too...
    monkeypatch.setenv("REPLAYLLM_TORCH_PROFILER_DIR", str(tmp_path / "ours"))  # ...ours wins
    llm.start_profile()
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3), use_tqdm=False)
    path = llm.stop_profile()
    assert os.path.dirname(path) == str(tmp_path / "ours") and os.path.isfile(path)
    names = {event.get("name", "") for event in json.load(open(path))["traceEvents"]}
    assert any(name.startswith("aten::") and ("mm" in name or "linear" in name) for name in names)  # the forward


def test_profile_errors(llm, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("REPLAYLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="REPLAYLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    monkeypatch.setenv("REPLAYLLM_TORCH_PROFILER_DIR", "/tmp")
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    os.remove(llm.stop_profile())
