"""Ground floor: the engine options a model's layer plan rules out or sets: hybrid models' recurrent layers
(hybrid_facts.resolve_hybrid_options), Gemma 4's uneven attention layers (gemma4_facts.resolve_gemma4_options).
Imports no folder of the package."""

from __future__ import annotations

from typing import Any

from .gemma4_facts import resolve_gemma4_options
from .hybrid_facts import resolve_hybrid_options


def resolve_layer_options(config: Any) -> None:
    """EngineConfig after its model is read: each layer plan's rules (ValueErrors, defaults) applied in place."""
    resolve_hybrid_options(config)
    resolve_gemma4_options(config)
