"""replayllm: a vLLM-style inference engine with trace replay. Public names load lazily (PEP 562)."""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ("replayllm.entrypoints.llm", "LLM"),
    "SamplingParams": ("replayllm.sampling.params", "SamplingParams"),
    "RequestOutputKind": ("replayllm.sampling.params", "RequestOutputKind"),
    "RequestOutput": ("replayllm.engine.outputs", "RequestOutput"),
    "CompletionOutput": ("replayllm.engine.outputs", "CompletionOutput"),
    "Logprob": ("replayllm.engine.outputs", "Logprob"),
    "TokensPrompt": ("replayllm.engine.outputs", "TokensPrompt"),
    "LLMEngine": ("replayllm.engine.llm_engine", "LLMEngine"),
    "EngineConfig": ("replayllm.engine.config", "EngineConfig"),
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        module, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'replayllm' has no attribute {name!r}")
