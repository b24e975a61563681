"""Ground floor: Inkling's layer plan read from its text config (transformers' InklingTextConfig), into ModelConfig
(each layer's KV cache shape), hybrid_facts (its four short convolutions' state per layer), the engine options it
rules out (resolve_inkling_options) and the model (models/inkling.py). Imports no folder of the package.

Every Inkling layer attends ("hybrid": full attention; "hybrid_sliding": a window of `sliding_window_size` keys, with
its own heads and head width, the `swa_*` keys) and runs four causal depthwise convolutions (k, v, the attention's
output, the MLP's output), so it keeps a KV cache and a convolution history per request: a parallel hybrid layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INKLING_ARCHITECTURES = ("InklingForCausalLM",)
KINDS = ("hybrid", "hybrid_sliding")


@dataclass(frozen=True)
class InklingLayer:
    sliding: bool
    heads: int  # q heads
    kv_heads: int
    head_dim: int
    rel_extent: int  # the relative bias spans distances 0 .. rel_extent - 1 (a sliding layer: its window)

    @property
    def kv_width(self) -> int:  # channels of the k (and of the v) convolution
        return self.kv_heads * self.head_dim


def inkling_layers(hf_config) -> tuple[InklingLayer, ...]:
    """Every layer's attention plan; ValueError for a config this engine does not honour."""
    n = int(hf_config.num_hidden_layers)
    kinds = list(getattr(hf_config, "layer_types", None) or [])
    if len(kinds) != n or set(kinds) - set(KINDS):
        raise ValueError(f"config.json: Inkling's layer_types {kinds} must name {n} layers, each one of {KINDS}")
    mlps = list(getattr(hf_config, "mlp_layer_types", None) or [])
    if len(mlps) != n or set(mlps) - {"dense", "sparse"}:
        raise ValueError(f"config.json: Inkling's mlp_layer_types {mlps} must name {n} layers, 'dense' / 'sparse'")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"Inkling with hidden_act {hf_config.hidden_act!r} is not supported (only 'silu')")
    if not getattr(hf_config, "shared_expert_sink", True):
        # transformers 5.25 always scores the shared experts with the routed ones; a config that says otherwise
        # asks for a router it does not define
        raise ValueError("Inkling with shared_expert_sink=false is not supported (transformers' router always "
                         "weighs the shared experts in the routed experts' normalisation)")
    if "sparse" in mlps and int(getattr(hf_config, "n_shared_experts", 0) or 0) < 1:
        raise ValueError("Inkling's router needs n_shared_experts >= 1 (its last logits are the shared experts')")
    full = InklingLayer(False, int(hf_config.num_attention_heads), int(hf_config.num_key_value_heads),
                        int(hf_config.head_dim), int(hf_config.rel_extent))
    window = int(hf_config.sliding_window_size)
    swa = InklingLayer(True, int(hf_config.swa_num_attention_heads), int(hf_config.swa_num_key_value_heads),
                       int(hf_config.swa_head_dim), window)
    for plan in (full, swa):
        if plan.heads % plan.kv_heads or plan.rel_extent < 1 or window < 1:
            raise ValueError(f"config.json: Inkling's heads ({plan.heads}) must be a multiple of its KV heads "
                             f"({plan.kv_heads}); rel_extent and sliding_window_size >= 1")
    return tuple(swa if kind == "hybrid_sliding" else full for kind in kinds)


def inkling_kv_shapes(architecture: str, hf_config) -> tuple[tuple[int, int], ...]:
    """(KV heads, head_dim) of each layer's cache where the two kinds differ; () otherwise or for another model."""
    if architecture not in INKLING_ARCHITECTURES:
        return ()
    shapes = tuple((p.kv_heads, p.head_dim) for p in inkling_layers(hf_config))
    return shapes if len(set(shapes)) > 1 else ()


def inkling_conv_channels(hf_config) -> int:
    """One layer's convolution history channels: k | v (the widest kind's) | attention output | MLP output."""
    return 2 * max(p.kv_width for p in inkling_layers(hf_config)) + 2 * int(hf_config.hidden_size)


def resolve_inkling_options(config: Any) -> None:
    """EngineConfig's options for Inkling: tensor parallelism is refused (its attention-output and MLP-output
    convolutions run over the whole hidden width after the ranks' sum: not split here), and so are CUDA graphs (its
    attention, with a relative bias per query and key, reads the step's host metadata: it runs eagerly)."""
    mc = config.model_config
    if mc.architecture not in INKLING_ARCHITECTURES:
        return
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} is not supported with Inkling yet "
                         "(its hidden-width convolutions are not split between ranks)")
    if config.cudagraph_mode not in (None, "NONE"):
        raise ValueError(f"cudagraph_mode={config.cudagraph_mode!r} is not supported with Inkling (its attention's "
                         "relative bias runs eagerly): use 'NONE'")
    config.cudagraph_mode = "NONE"
