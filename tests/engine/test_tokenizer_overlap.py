"""The tokenizer loads on a thread while the engine core builds its runner (engine/input_processor.py
`load_in_background`): both LLMEngine and the engine core process build the InputProcessor off the main thread,
EngineCore waits for the tokenizer only where the grammars need it, and a tokenizer that cannot load still fails
the engine's construction with its own error."""

from __future__ import annotations

import threading

import pytest

from replayllm import LLM
from replayllm.engine import input_processor
from replayllm.engine.engine_core import EngineCore


def test_the_tokenizer_loads_off_the_main_thread_beside_the_runner(monkeypatch):
    events = []
    original_init, original_core = input_processor.InputProcessor.__init__, EngineCore.__init__

    def recording_init(self, config):
        events.append(("tokenizer", threading.current_thread().name))
        original_init(self, config)

    def recording_core(self, config, tokenizer):
        events.append(("core", type(tokenizer).__name__))
        original_core(self, config, tokenizer)

    monkeypatch.setattr(input_processor.InputProcessor, "__init__", recording_init)
    monkeypatch.setattr(EngineCore, "__init__", recording_core)
    llm = LLM("replayllm/tiny-qwen3", device="cpu")
    assert ("core", "Future") in events  # the core got the tokenizer still loading
    (name,) = [n for kind, n in events if kind == "tokenizer"]
    assert name.startswith("replayllm-tokenizer")
    assert llm.llm_engine.structured._tokenizer is llm.llm_engine.input_processor.tokenizer  # resolved, the same
    out = llm.generate(["Hello"], use_tqdm=False)[0]
    assert out.outputs[0].text is not None
    llm.shutdown()


def test_a_tokenizer_that_cannot_load_fails_the_engine(monkeypatch):
    def broken(config):
        raise OSError("no tokenizer files here")

    monkeypatch.setattr(input_processor, "load_tokenizer", broken)
    with pytest.raises(OSError, match="no tokenizer files here"):
        LLM("replayllm/tiny-qwen3", device="cpu")
    assert not [t for t in threading.enumerate() if t.name.startswith("replayllm-tokenizer")]
