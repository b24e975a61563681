"""Ground floor: Dots 3 Note's per-layer attention plan read from its text config (transformers' Dots3NoteTextConfig),
into ModelConfig (each layer's KV cache shape, the served context's cap) and the model (models/dots3_note.py). Imports
no folder of the package.

Dots 3 Note's layers are of two kinds (`layer_types`): "indexed_attention" (DeepSeek Sparse Attention: MLA with an
indexer choosing each query's `index_topk` keys; "full_attention" without the indexer where the config sets
use_dsa false) and "sliding_attention" (MLA over a window of `sliding_window` keys). The sliding layers have their own
heads, latent ranks and head widths (transformers >= 5.25's `per_layer_config`, from the hub's `swa_*` keys) and
their own rope theta; every layer's KV cache holds its heads' expanded K and V (models/mla.py), so the two kinds'
caches differ in shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .gemma4_facts import open_config

DOTS3_ARCHITECTURES = ("Dots3NoteForCausalLM",)
KINDS = ("indexed_attention", "full_attention", "sliding_attention")
# the attributes a layer's per_layer_config may set (what the hub's swa_* keys become); any other is refused
PER_LAYER_KEYS = frozenset({"num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "head_dim",
                            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})


@dataclass(frozen=True)
class Dots3Layer:
    kind: str  # one of KINDS
    heads: int  # q heads, each its own K and V head in the cache
    q_lora_rank: int
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim: the rotating part of each q / k head
    v_dim: int  # v_head_dim (padded to nope + rope in the cache)
    theta: float  # this kind's rope_theta

    @property
    def head_dim(self) -> int:  # q / k width, and the cache's
        return self.nope + self.rope


def dots3_layers(hf_config) -> tuple[Dots3Layer, ...]:
    """Every decoder layer's attention plan; ValueError for a config transformers' Dots3Note would not build or one
    this engine does not serve (rope scaling, per-layer keys beyond the attention geometry). The layers of a kind share
    one geometry (transformers' config refuses another: its rotary is one per kind)."""
    c = open_config(hf_config)
    n = int(c.num_hidden_layers)
    kinds = list(getattr(c, "layer_types", None) or [])
    if len(kinds) != n or set(kinds) - set(KINDS):
        raise ValueError(f"config.json: Dots 3 Note's layer_types {kinds} must name {n} layers, each one of {KINDS}")
    varying = set(getattr(c, "per_layer_attributes", None) or ())
    if varying - PER_LAYER_KEYS:
        raise ValueError(f"config.json: Dots 3 Note's per_layer_config sets {sorted(varying - PER_LAYER_KEYS)}, "
                         f"which this engine does not serve per layer (only {sorted(PER_LAYER_KEYS)})")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    per_layer = getattr(c, "per_layer_config", None)
    plans = []
    for i, kind in enumerate(kinds):
        layer = per_layer[i] if per_layer is not None else c
        params = rope.get(kind)
        if not isinstance(params, dict):
            raise ValueError(f"config.json: Dots 3 Note's rope_parameters has no {kind!r} entry")
        if (params.get("rope_type") or "default") != "default":
            raise ValueError(f"Dots 3 Note with rope_type {params.get('rope_type')!r} in its {kind} layers is not "
                             "supported (its attention keeps qk_head_dim^-0.5 whatever the scaling: only 'default')")
        if layer.q_lora_rank is None:
            raise ValueError("config.json: Dots 3 Note needs q_lora_rank (its queries through a LoRA)")
        if int(layer.num_key_value_heads) != int(layer.num_attention_heads):
            raise ValueError(f"config.json: layer {i}'s num_key_value_heads={layer.num_key_value_heads} must equal "
                             f"its num_attention_heads={layer.num_attention_heads} (MLA: a K/V head per q head)")
        plan = Dots3Layer(kind, int(layer.num_attention_heads), int(layer.q_lora_rank), int(layer.kv_lora_rank),
                          int(layer.qk_nope_head_dim), int(layer.qk_rope_head_dim), int(layer.v_head_dim),
                          float(params.get("rope_theta", 10000.0)))
        # transformers' rotary rotates int(head_dim * partial_rotary_factor) elements, its attention qk_rope_head_dim
        rotated = int(int(layer.head_dim or 0) * float(params.get("partial_rotary_factor", 1.0)))
        if rotated != plan.rope or plan.rope < 2 or plan.rope % 2 or not 1 <= plan.v_dim <= plan.head_dim:
            raise ValueError(f"config.json: layer {i} ({kind}) rotates {rotated} elements for qk_rope_head_dim="
                             f"{plan.rope} (head_dim x partial_rotary_factor must be it, even), v_head_dim="
                             f"{plan.v_dim} at most qk_nope_head_dim + qk_rope_head_dim={plan.head_dim}")
        plans.append(plan)
    return tuple(plans)


def dots3_kv_shapes(architecture: str, hf_config) -> tuple[tuple[int, int], ...]:
    """(KV heads, head_dim) of each layer's cache for Dots 3 Note (where they differ between layers); () for another
    architecture or a Dots 3 Note of one geometry. Opens the config (its per-layer guard) for the engine's global
    reads, which are the indexed layers' values."""
    if architecture not in DOTS3_ARCHITECTURES:
        return ()
    shapes = tuple((p.heads, p.head_dim) for p in dots3_layers(hf_config))
    return shapes if len(set(shapes)) > 1 else ()


def dots3_attention_limit(architecture: str, hf_config) -> int | None:
    """The served context's cap: index_topk where an indexed layer is (within it every key is chosen: the layer is
    dense MLA, as run here); None without one (use_dsa false: full attention at any length)."""
    if architecture not in DOTS3_ARCHITECTURES or "indexed_attention" not in (hf_config.layer_types or ()):
        return None
    return int(hf_config.index_topk)


def resolve_dots3_options(config: Any) -> str | None:
    """EngineConfig's options for Dots 3 Note: a tensor-parallel size must divide every layer's heads and the shared
    experts' width. Returns why piecewise CUDA graphs do not fit it (their buffers assume one head shape: the sliding
    layers' differ), None for another model or one of one geometry."""
    mc, tp = config.model_config, config.tensor_parallel_size
    if mc.architecture not in DOTS3_ARCHITECTURES:
        return None
    hf = mc.hf_config
    shared = int(hf.shared_experts_intermediate_size) * int(hf.n_shared_experts or 0)
    uneven = sorted({p.heads for p in dots3_layers(hf) if p.heads % tp} | ({shared} if shared % tp else set()))
    if uneven:
        raise ValueError(f"tensor_parallel_size={tp} must divide every Dots 3 Note layer's heads and its shared "
                         f"experts' width, got {uneven}")
    return "Dots 3 Note: its sliding layers' head shapes differ" if mc.kv_layer_shapes else None
