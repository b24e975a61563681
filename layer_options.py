"""Ground floor: the engine options a model's layer plan rules out or sets: hybrid models' recurrent layers
(hybrid_facts.resolve_hybrid_options), Gemma 4's uneven attention layers (gemma4_facts.resolve_gemma4_options), Dots 3
Note's (dots3_facts.resolve_dots3_options), and for any of them the CUDA graphs: piecewise ones do not fit them, so
steps other than uniform decode run eagerly (cudagraph_mode FULL_DECODE_ONLY by default; PIECEWISE /
FULL_AND_PIECEWISE a ValueError). Imports no folder of the package."""

from __future__ import annotations

from typing import Any

from .dots3_facts import resolve_dots3_options
from .gemma4_facts import resolve_gemma4_options
from .hybrid_facts import resolve_hybrid_options
from .inkling_facts import resolve_inkling_options


def resolve_layer_options(config: Any) -> None:
    """EngineConfig after its model is read: each layer plan's rules (ValueErrors, defaults) applied in place."""
    resolve_inkling_options(config)  # no TP, no CUDA graphs (before the hybrid rules, which default to graphs)
    why = resolve_hybrid_options(config) or resolve_gemma4_options(config) or resolve_dots3_options(config)
    if why is None:
        return
    if config.cudagraph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        raise ValueError(f"cudagraph_mode={config.cudagraph_mode!r} is not supported with {why} (use "
                         "'FULL_DECODE_ONLY' or 'NONE')")
    if config.cudagraph_mode is None:
        config.cudagraph_mode = "FULL_DECODE_ONLY"
