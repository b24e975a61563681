"""The tokenizer loads on a thread while LLMEngine builds its runner (engine/input_processor.py
`load_in_background`), EngineCore's grammars wait for it only at their first compile, and a tokenizer that cannot
load still fails LLMEngine's construction with its own error. The engine core process loads its tokenizer (for
grammars only) after it is ready (`load_tokenizer_into`): a grammar waits for it, and its error reaches the
grammar's request."""

from __future__ import annotations

import threading

import pytest

from replayllm import LLM
from replayllm.engine import input_processor
from replayllm.engine.engine_core import EngineCore


def test_the_tokenizer_loads_off_the_main_thread_beside_the_runner(monkeypatch):
    events = []
    original_init, original_core = input_processor.InputProcessor.__init__, EngineCore.__init__

    def recording_init(self, config, with_tokenizer=True):
        events.append(("tokenizer", threading.current_thread().name))
        original_init(self, config, with_tokenizer)

    def recording_core(self, config, tokenizer):
        events.append(("core", type(tokenizer).__name__))
        original_core(self, config, tokenizer)

    monkeypatch.setattr(input_processor.InputProcessor, "__init__", recording_init)
    monkeypatch.setattr(EngineCore, "__init__", recording_core)
    llm = LLM("replayllm/tiny-qwen3", device="cpu")
    assert ("core", "Future") in events  # the core got the tokenizer still loading
    (name,) = [n for kind, n in events if kind == "tokenizer"]
    assert name.startswith("replayllm-tokenizer")
    # the grammars keep the future (resolved by their first compile): the same tokenizer
    assert llm.llm_engine.structured._tokenizer.result() is llm.llm_engine.input_processor.tokenizer
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


def test_a_grammar_waits_for_a_tokenizer_still_loading(monkeypatch):
    """The engine core process's order: the core is built with a pending tokenizer, which loads on a thread
    later (`load_tokenizer_into`); the first grammar compile waits for it; a load that fails fails the grammar."""
    from concurrent.futures import Future

    from replayllm.config import EngineConfig
    from replayllm.engine.structured_output_manager import StructuredOutputManager
    from replayllm.structured_outputs import StructuredOutputsParams

    config = EngineConfig(model="replayllm/tiny-qwen3", device="cpu")
    assert input_processor.InputProcessor(config, with_tokenizer=False).tokenizer is None
    pending: Future = Future()
    manager = StructuredOutputManager(pending, config.model_config.vocab_size, config.model_config.eos_token_ids)
    grammar = manager.add_request(StructuredOutputsParams(choice=["yes", "no"]))
    grammar.wait(timeout=0.5)
    assert not grammar.ready  # compiling: waiting for the tokenizer
    input_processor.load_tokenizer_into(pending, config)
    grammar.wait(timeout=60)
    assert grammar.ready and grammar.error is None
    manager.shutdown()

    def broken(config):
        raise OSError("no tokenizer files here")

    monkeypatch.setattr(input_processor, "load_tokenizer", broken)
    failing: Future = Future()
    input_processor.load_tokenizer_into(failing, config)
    manager = StructuredOutputManager(failing, config.model_config.vocab_size, config.model_config.eos_token_ids)
    grammar = manager.add_request(StructuredOutputsParams(choice=["yes", "no"]))
    grammar.wait(timeout=60)
    assert grammar.ready and "no tokenizer files here" in str(grammar.error)
    manager.shutdown()
