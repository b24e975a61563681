"""Ground floor: Gemma 4's per-layer plan read from its text config (transformers' Gemma4TextConfig): each layer's
kind, attention geometry, KV source and MLP width, into ModelConfig (the KV cache's per-layer shapes) and the model
(models/gemma4.py). Imports no folder of the package.

Gemma 4's layers differ where Gemma 3's were uniform: full-attention layers have their own head dim
(`global_head_dim`, 512 in the releases) and, with `attention_k_eq_v`, their own KV heads
(`num_global_key_value_heads`) and no v_proj (V is K's projection); transformers >= 5.25 writes both as
`per_layer_config` and refuses global reads of them unless `allow_global_per_layer_attribute_access` is set. The last
`num_kv_shared_layers` layers compute no K/V: each attends over the cache of the last earlier layer of its kind, and
with `use_double_wide_mlp` its MLP is twice as wide.

Gemma 3n (`Gemma3nForCausalLM`, the released `Gemma3nForConditionalGeneration`) has the same per-layer inputs and KV
sharing over uniform layers (one head dim and KV head count), an MLP width per layer (`intermediate_size` a list):
its plan comes from the same function (`layer_plans`), as does MiMo-V2-Flash's (no sharing; its sliding layers twice
the full layers' KV heads)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
GEMMA3N_ARCHITECTURES = ("Gemma3nForCausalLM", "Gemma3nForConditionalGeneration")
PLE_ARCHITECTURES = GEMMA4_ARCHITECTURES + GEMMA3N_ARCHITECTURES  # a layer plan each (KV sharing, per-layer inputs)
# MiMo-V2-Flash: twice the KV heads in its sliding layers (their own KV cache shape), one head dim
MIMO_ARCHITECTURES = ("MiMoV2FlashForCausalLM",)
# Laguna: q heads per layer (num_attention_heads_per_layer), one KV shape
PER_LAYER_Q_ARCHITECTURES = ("LagunaForCausalLM",)
_KINDS = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class Gemma4LayerPlan:
    kind: str  # "sliding_attention" / "full_attention"
    head_dim: int
    kv_heads: int
    k_eq_v: bool  # no v_proj: V is the raw k_proj output (full layers with attention_k_eq_v)
    kv_layer: int  # the KV cache it attends over: its own (counted among the cache-owning layers) or its producer's
    shares_kv: bool  # computes no K/V (one of the last num_kv_shared_layers)
    mlp_width: int


def open_config(hf_config):
    """The config with transformers' per-layer guard off (its global head_dim / num_key_value_heads read as the
    sliding layers', which they are); returned for chaining."""
    try:
        hf_config.allow_global_per_layer_attribute_access = True
    except (AttributeError, TypeError):
        pass
    return hf_config


def _geometry(hf_config, i: int, kind: str) -> tuple[int, int]:
    """(head_dim, KV heads) of layer i: transformers >= 5.25's per_layer_config, else the released keys."""
    per_layer = getattr(hf_config, "per_layer_config", None)
    if per_layer is not None and not isinstance(per_layer, dict):
        layer = per_layer[i]
        return int(layer.head_dim), int(layer.num_key_value_heads)
    head_dim, kv = int(hf_config.head_dim), int(hf_config.num_key_value_heads)
    if isinstance(per_layer, dict):  # config.json's form, keys like "05"
        entry = next((v for k, v in per_layer.items() if int(k) == i), {})
        return int(entry.get("head_dim", head_dim)), int(entry.get("num_key_value_heads", kv))
    if kind != "full_attention":
        return head_dim, kv
    global_kv = getattr(hf_config, "num_global_key_value_heads", None)
    if getattr(hf_config, "attention_k_eq_v", False) and global_kv is not None:
        kv = int(global_kv)
    return int(getattr(hf_config, "global_head_dim", None) or 512), kv


def layer_plans(architecture: str, hf_config) -> tuple[Gemma4LayerPlan, ...]:
    """A Gemma 4, Gemma 3n or MiMo-V2-Flash model's layer plans; () for another architecture."""
    if architecture in MIMO_ARCHITECTURES:
        return mimo_layers(hf_config)
    if architecture not in PLE_ARCHITECTURES:
        return ()
    return gemma4_layers(hf_config, uniform=architecture in GEMMA3N_ARCHITECTURES)


def mimo_layers(hf_config) -> tuple[Gemma4LayerPlan, ...]:
    """MiMo-V2-Flash's layers: `head_dim` q/k heads (V narrower: `v_head_dim`, padded to head_dim in the cache),
    `num_key_value_heads` KV heads in the full layers and twice that in the sliding ones (transformers' rule)."""
    n, kv, head_dim = int(hf_config.num_hidden_layers), int(hf_config.num_key_value_heads), int(hf_config.head_dim)
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    if len(kinds) != n or set(kinds) - set(_KINDS):
        raise ValueError(f"config.json: MiMo-V2-Flash's layer_types {kinds} must name {n} layers, each one of {_KINDS}")
    v_dim = int(getattr(hf_config, "v_head_dim", None) or head_dim)
    if not 1 <= v_dim <= head_dim:
        raise ValueError(f"config.json: v_head_dim={v_dim} must be between 1 and head_dim={head_dim} (V is padded to "
                         "the q/k heads' width in the KV cache)")
    widths = _mlp_widths(hf_config, n)
    return tuple(Gemma4LayerPlan(kind, head_dim, kv * (2 if kind == "sliding_attention" else 1), False, i, False,
                                 width) for i, (kind, width) in enumerate(zip(kinds, widths)))


def _mlp_widths(c, n: int) -> list[int]:
    width = c.intermediate_size
    widths = [int(w) for w in width] if isinstance(width, (list, tuple)) else [int(width)] * n
    if len(widths) != n:
        raise ValueError(f"config.json: intermediate_size names {len(widths)} widths for {n} layers")
    return widths


def gemma4_layers(hf_config, uniform: bool = False) -> tuple[Gemma4LayerPlan, ...]:
    """Every decoder layer's plan; ValueError for a config transformers' Gemma 4 would not build, or one this
    build does not serve (bidirectional attention over all tokens: an embedding model). uniform: Gemma 3n's layers,
    every one `head_dim` x `num_key_value_heads` with its own V projection."""
    c = open_config(hf_config)
    n = int(c.num_hidden_layers)
    kinds = list(getattr(c, "layer_types", None) or [])
    if len(kinds) != n or set(kinds) - set(_KINDS):
        raise ValueError(f"config.json: Gemma 4's layer_types {kinds} must name {n} layers, each one of {_KINDS}")
    if getattr(c, "use_bidirectional_attention", None) not in (None, False, "vision"):
        raise ValueError(f"Gemma 4 with use_bidirectional_attention={c.use_bidirectional_attention!r} (an embedding "
                         "model) is not supported")
    shared = int(getattr(c, "num_kv_shared_layers", 0) or 0)
    first_shared = n - shared
    if not 0 <= shared < n:
        raise ValueError(f"config.json: num_kv_shared_layers={shared} must leave at least one of the {n} layers "
                         "its own KV cache")
    producer = {kind: max((i for i in range(first_shared) if kinds[i] == kind), default=None) for kind in _KINDS}
    widths = _mlp_widths(c, n)
    double = bool(getattr(c, "use_double_wide_mlp", False))
    plans = []
    for i, (kind, width) in enumerate(zip(kinds, widths)):
        head_dim, kv_heads = (int(c.head_dim), int(c.num_key_value_heads)) if uniform else _geometry(c, i, kind)
        k_eq_v = bool(getattr(c, "attention_k_eq_v", False)) and kind == "full_attention" and not uniform
        shares = i >= first_shared
        if shares and producer[kind] is None:
            raise ValueError(f"config.json: layer {i} ({kind}) shares the KV cache of an earlier {kind} layer, but "
                             f"none of the first {first_shared} layers is one")
        plans.append(Gemma4LayerPlan(kind, head_dim, kv_heads, k_eq_v, producer[kind] if shares else i, shares,
                                     2 * width if shares and double else width))
    return tuple(plans)


def resolve_gemma4_options(config: Any) -> str | None:
    """EngineConfig's options for Gemma 4 and Gemma 3n: a tensor-parallel size must divide every layer's KV heads (the
    full layers' own count too: gemma-4-31B's 4). Returns why piecewise CUDA graphs do not fit it (Gemma 4: their
    buffers assume one head dim for every layer; Gemma 3n: its layers pass four AltUp streams, not one residual:
    layer_options), None for another model."""
    mc, tp = config.model_config, config.tensor_parallel_size
    if mc.architecture in PER_LAYER_Q_ARCHITECTURES:
        return "Laguna: its layers' q heads differ"
    if mc.architecture not in PLE_ARCHITECTURES + MIMO_ARCHITECTURES:
        return None
    name = {**dict.fromkeys(GEMMA3N_ARCHITECTURES, "Gemma 3n"), **dict.fromkeys(MIMO_ARCHITECTURES, "MiMo-V2-Flash")
            }.get(mc.architecture, "Gemma 4")
    uneven = sorted({heads for heads, _ in mc.kv_layer_shapes if heads % tp})
    if uneven:
        raise ValueError(f"tensor_parallel_size={tp} must divide every {name} layer's KV heads, got {uneven} (each "
                         "rank caches whole heads; replicated KV heads are not built)")
    pattern = getattr(mc.hf_config, "activation_sparsity_pattern", None) or 0.0
    if name == "Gemma 3n" and tp > 1 and any(s > 0 for s in (pattern if isinstance(pattern, (list, tuple))
                                                             else [pattern])):
        raise ValueError(f"tensor_parallel_size={tp} is not supported with Gemma 3n's activation sparsity "
                         "(activation_sparsity_pattern: each MLP gate row's mean and std need the whole row)")
    if name == "Gemma 3n":
        return "Gemma 3n: its layers pass four AltUp streams"
    if name == "MiMo-V2-Flash":
        return "MiMo-V2-Flash: its layers' KV heads differ (not yet run in piecewise graphs)"
    return "Gemma 4: its layers' head dims differ"
