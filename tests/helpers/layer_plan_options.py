"""The engine options a layer plan rules out (layer_options.py: Gemma 4, Gemma 3n, MiMo-V2-Flash, hybrids): decode
steps keep full CUDA graphs by default, and each refused option is a clear ValueError."""

from __future__ import annotations

import pytest

from replayllm.config import EngineConfig


def assert_options_refused(path: str, refused: list[tuple[dict, str]]) -> EngineConfig:
    """`path`'s EngineConfig: cudagraph_mode FULL_DECODE_ONLY by default; each (options, message regex) refused.
    Returns the default config."""
    config = EngineConfig(model=path, device="cpu", skip_tokenizer_init=True)
    assert config.cudagraph_mode == "FULL_DECODE_ONLY"
    for options, says in refused:
        with pytest.raises(ValueError, match=says):
            EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, **options)
    return config
