"""Ground floor: the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5: Gated DeltaNet; Granite 4.0-H:
Mamba-2; each beside full attention), read from the config alone into ModelConfig, and the engine options they rule
out. Such a layer keeps a recurrent state per request (its last convolution inputs and a matrix per head) instead of
a KV cache: docs/hybrid_models.md. Imports no folder of the package."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# architectures whose `layer_types` mix "linear_attention" (Gated DeltaNet) with "full_attention"
GATED_DELTANET_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# architectures whose Mamba-2 layers ("mamba", transformers >= 5.25: "linear_attention") sit beside attention
MAMBA2_ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)
_LINEAR, _FULL = ("linear_attention", "mamba"), ("full_attention", "attention")


def layer_types(hf_config) -> list[str]:
    """Each decoder layer's kind, "linear_attention" or "full_attention" (the older names "mamba" and "attention"
    read as these): the config's `layer_types`, else every `full_attention_interval`-th layer (4 by default,
    transformers' rule for Qwen3-Next) full attention and the others linear."""
    types = getattr(hf_config, "layer_types", None)
    if not types:
        interval = int(getattr(hf_config, "full_attention_interval", 4) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(hf_config.num_hidden_layers)]
    if len(types) != hf_config.num_hidden_layers or set(types) - set(_LINEAR + _FULL):
        raise ValueError(f"config.json: layer_types={list(types)} must name {hf_config.num_hidden_layers} layers, each "
                         f"one of {_LINEAR + _FULL}")
    return ["linear_attention" if kind in _LINEAR else "full_attention" for kind in types]


def recurrent_layers(architecture: str, hf_config) -> tuple[int, ...]:
    """The decoder layers that keep a recurrent state instead of a KV cache (none for other architectures)."""
    if architecture not in GATED_DELTANET_ARCHITECTURES + MAMBA2_ARCHITECTURES:
        return ()
    return tuple(i for i, kind in enumerate(layer_types(hf_config)) if kind == "linear_attention")


@dataclass(frozen=True)
class RecurrentShape:
    """One linear layer's state per request: the last kernel - 1 inputs of its causal depthwise convolution over
    conv_dim channels (the model's dtype), and its recurrent state (fp32): Gated DeltaNet's [Hv, Dk, Dv] (conv
    channels q | k | v: 2 Hk Dk + Hv Dv), Mamba-2's [heads, head_dim, d_state] (channels x | B | C: heads x head_dim
    + 2 n_groups d_state)."""

    conv_dim: int
    conv_kernel: int
    state_dims: tuple[int, int, int]

    @classmethod
    def of(cls, architecture: str, hf_config) -> RecurrentShape:
        if architecture in MAMBA2_ARCHITECTURES:
            m = Mamba2Dims.from_hf_config(hf_config)
            return cls(m.intermediate + 2 * m.n_groups * m.d_state, m.conv_kernel, (m.n_heads, m.head_dim, m.d_state))
        hk, hv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
        dk, dv = int(hf_config.linear_key_head_dim), int(hf_config.linear_value_head_dim)
        kernel = int(hf_config.linear_conv_kernel_dim)
        if hv % hk or kernel < 1:
            raise ValueError(f"config.json: linear_num_value_heads={hv} must be a multiple of "
                             f"linear_num_key_heads={hk}, linear_conv_kernel_dim >= 1")
        return cls(2 * hk * dk + hv * dv, kernel, (hv, dk, dv))

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_kernel - 1, self.conv_dim)

    def recurrent_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, *self.state_dims)

    def slot_bytes(self, conv_itemsize: int) -> int:
        """Bytes of one request's state in one layer (the recurrent state in fp32)."""
        a, b, c = self.state_dims
        return (self.conv_kernel - 1) * self.conv_dim * conv_itemsize + a * b * c * 4


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba-2 mixer's sizes from Granite 4.0-H's config keys: heads x head_dim = intermediate
    (mamba_expand x hidden_size), n_groups groups of B / C of d_state each, a convolution of conv_kernel."""

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int

    @property
    def intermediate(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config) -> Mamba2Dims:
        heads = int(hf_config.mamba_n_heads)
        inter = int(getattr(hf_config, "mamba_expand", 2) * hf_config.hidden_size)
        head_dim = getattr(hf_config, "mamba_d_head", "auto")
        head_dim = inter // heads if head_dim in (None, "auto") else int(head_dim)
        dims = cls(heads, head_dim, int(hf_config.mamba_d_state), int(getattr(hf_config, "mamba_n_groups", 1) or 1),
                   int(getattr(hf_config, "mamba_d_conv", 4)))
        if dims.intermediate != inter or heads % dims.n_groups:
            raise ValueError(f"config.json: mamba_n_heads={heads} x mamba_d_head={head_dim} must equal mamba_expand x "
                             f"hidden_size={inter}, and mamba_n_groups={dims.n_groups} divide the heads")
        return dims


def resolve_hybrid_options(config: Any) -> None:
    """EngineConfig's options for a model with recurrent layers (config.model_config.recurrent_layers): a request's
    state lives in its slot and advances with every token it runs, so what needs a state at an arbitrary earlier
    position is refused (speculative decoding's rejected drafts, tensor parallelism of the linear layers: not
    built) or turned off (prefix caching, as vLLM: a cached prefix's state is not kept), and steps other than
    uniform decode run eagerly (cudagraph_mode FULL_DECODE_ONLY: the piecewise graphs split at attention only)."""
    mc = config.model_config
    if not mc.recurrent_layers:
        return
    RecurrentShape.of(mc.architecture, mc.hf_config)  # its config errors now, not at load
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
