"""Ground floor: the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet beside full
attention), read from the config alone into ModelConfig, and the engine options they rule out. Such a layer keeps
a recurrent state per request (its last convolution inputs and a [Hv, Dk, Dv] matrix) instead of a KV cache:
docs/hybrid_models.md. Imports no folder of the package."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# architectures whose `layer_types` mix "linear_attention" (Gated DeltaNet) with "full_attention"
GATED_DELTANET_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
_KINDS = ("linear_attention", "full_attention")


def layer_types(hf_config) -> list[str]:
    """Each decoder layer's kind: the config's `layer_types`, else every `full_attention_interval`-th layer (4 by
    default, transformers' rule) full attention and the others linear."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        return list(types)
    interval = int(getattr(hf_config, "full_attention_interval", 4) or 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(hf_config.num_hidden_layers)]


def recurrent_layers(architecture: str, hf_config) -> tuple[int, ...]:
    """The decoder layers that keep a recurrent state instead of a KV cache (none for other architectures)."""
    if architecture not in GATED_DELTANET_ARCHITECTURES:
        return ()
    types = layer_types(hf_config)
    if len(types) != hf_config.num_hidden_layers or set(types) - set(_KINDS):
        raise ValueError(f"config.json: layer_types={types} must name {hf_config.num_hidden_layers} layers, each one "
                         f"of {_KINDS}")
    return tuple(i for i, kind in enumerate(types) if kind == "linear_attention")


@dataclass(frozen=True)
class RecurrentShape:
    """One Gated DeltaNet layer's state per request: the last kernel - 1 inputs of its convolution over
    conv_dim = 2 Hk Dk + Hv Dv channels (q | k | v, the model's dtype), and the delta rule's [Hv, Dk, Dv] (fp32)."""

    num_k_heads: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @classmethod
    def from_hf_config(cls, hf_config) -> RecurrentShape:
        shape = cls(int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads),
                    int(hf_config.linear_key_head_dim), int(hf_config.linear_value_head_dim),
                    int(hf_config.linear_conv_kernel_dim))
        if shape.num_v_heads % shape.num_k_heads or shape.conv_kernel < 1:
            raise ValueError(f"config.json: linear_num_value_heads={shape.num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={shape.num_k_heads}, linear_conv_kernel_dim >= 1")
        return shape

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.key_head_dim + self.num_v_heads * self.value_head_dim

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_kernel - 1, self.conv_dim)

    def delta_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, self.num_v_heads, self.key_head_dim, self.value_head_dim)

    def slot_bytes(self, conv_itemsize: int) -> int:
        """Bytes of one request's state in one layer (the delta rule's in fp32)."""
        return ((self.conv_kernel - 1) * self.conv_dim * conv_itemsize
                + self.num_v_heads * self.key_head_dim * self.value_head_dim * 4)


def resolve_hybrid_options(config: Any) -> None:
    """EngineConfig's options for a model with recurrent layers (config.model_config.recurrent_layers): a request's
    state lives in its slot and advances with every token it runs, so what needs a state at an arbitrary earlier
    position is refused (speculative decoding's rejected drafts, tensor parallelism of the linear layers: not
    built) or turned off (prefix caching, as vLLM: a cached prefix's state is not kept), and steps other than
    uniform decode run eagerly (cudagraph_mode FULL_DECODE_ONLY: the piecewise graphs split at attention only)."""
    mc = config.model_config
    if not mc.recurrent_layers:
        return
    name = f"{mc.architecture} (linear-attention layers {list(mc.recurrent_layers)})"
    if config.speculative_config is not None:
        raise ValueError(f"speculative decoding is not supported with {name}: a rejected draft would leave its "
                         "tokens in the recurrent state")
    if config.tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size > 1 is not supported with {name} yet")
    if config.cudagraph_mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        raise ValueError(f"cudagraph_mode={config.cudagraph_mode!r} is not supported with {name}: its linear-attention "
                         "layers run eagerly outside uniform decode steps (use 'FULL_DECODE_ONLY' or 'NONE')")
    if config.cudagraph_mode is None:
        config.cudagraph_mode = "FULL_DECODE_ONLY"
    if config.enable_prefix_caching:
        logger.warning("prefix caching is off for %s: a cached prefix's recurrent state is not kept", name)
        config.enable_prefix_caching = False
