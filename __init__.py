"""replayllm: a vLLM-style inference engine with trace replay. Public names load lazily (PEP 562)."""

from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ("replayllm.entrypoints.llm", "LLM"),
    "SamplingParams": ("replayllm.sampling_params", "SamplingParams"),
    "RequestOutputKind": ("replayllm.sampling_params", "RequestOutputKind"),
    "RepetitionDetectionParams": ("replayllm.sampling_params", "RepetitionDetectionParams"),
    "StructuredOutputsParams": ("replayllm.structured_outputs", "StructuredOutputsParams"),
    "RequestOutput": ("replayllm.outputs", "RequestOutput"),
    "CompletionOutput": ("replayllm.outputs", "CompletionOutput"),
    "Logprob": ("replayllm.outputs", "Logprob"),
    "TokensPrompt": ("replayllm.outputs", "TokensPrompt"),
    "LLMEngine": ("replayllm.engine.llm_engine", "LLMEngine"),
    "EngineConfig": ("replayllm.config", "EngineConfig"),
    "score": ("replayllm.entrypoints.score", "score"),
    "BeamSearchParams": ("replayllm.sampling_params", "BeamSearchParams"),
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
