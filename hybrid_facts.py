"""Ground floor: the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5, OLMo Hybrid, Lara-4-Mini,
Qwen4-Exp: Gated DeltaNet; Kimi Linear, Ling 3: Kimi Delta Attention; MiniMax-Text-01: Lightning Attention; Granite
4.0-H, NemotronH, Bamba, Falcon-H1, Zamba2: Mamba-2; Jamba: Mamba-1; LFM2: a gated short convolution; each beside
attention, Falcon-H1's in the same layers, Zamba2's after shared attention blocks) and of the attention-free Mamba
models, read from the config alone into ModelConfig, and the engine options they rule out. Such a layer keeps a
recurrent state per request (its last convolution inputs, and but for LFM2's a matrix per head) instead of a KV
cache: docs/hybrid_models.md. Imports no folder of the package."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from .inkling_facts import INKLING_ARCHITECTURES, inkling_conv_channels

logger = logging.getLogger(__name__)

# architectures whose `layer_types` mix "linear_attention" (Gated DeltaNet) with "full_attention"
GATED_DELTANET_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                "OlmoHybridForCausalLM", "LaraMiniForCausalLM", "Qwen4ExpForCausalLM",
                                "Qwen4ExpForConditionalGeneration")
# architectures whose "linear_attention" layers are Kimi Delta Attention (the delta rule with a decay per key channel)
KDA_ARCHITECTURES = ("KimiLinearForCausalLM", "BailingHybridForCausalLM")
# architectures whose "linear_attention" layers are Lightning Attention (a fixed decay per head, no convolution)
LIGHTNING_ARCHITECTURES = ("MiniMaxForCausalLM",)
# architectures whose Mamba-2 layers ("mamba", transformers >= 5.25: "linear_attention") sit beside attention
MAMBA2_ARCHITECTURES = ("GraniteMoeHybridForCausalLM", "NemotronHForCausalLM", "BambaForCausalLM",
                        "FalconH1ForCausalLM", "Mamba2ForCausalLM", "Zamba2ForCausalLM")
# architectures whose every layer runs attention and a Mamba-2 mixer side by side: a KV cache and a state in each
PARALLEL_HYBRID_ARCHITECTURES = ("FalconH1ForCausalLM", *INKLING_ARCHITECTURES)
# architectures whose every layer is a Mamba-2 mixer, the "hybrid" ones running a shared attention block before it (a
# KV cache each beside the state): Zamba2
SHARED_BLOCK_ARCHITECTURES = ("Zamba2ForCausalLM",)
# architectures whose Mamba-1 layers (A per channel and state element) sit beside attention (Jamba) or make the whole
# model (Mamba, FalconMamba)
MAMBA1_ARCHITECTURES = ("JambaForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM")
# architectures without an attention layer: every layer a recurrent one (no KV cache at all)
ATTENTION_FREE_ARCHITECTURES = ("MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM")
# architectures whose "conv" layers (a gated short convolution, no recurrent matrix) sit beside attention: LFM2
SHORT_CONV_ARCHITECTURES = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm3ForCausalLM")
# Inkling's four short convolutions per layer (k, v, attention output, MLP output: one history, inkling_facts) sit
# beside its attention in every layer (PARALLEL_HYBRID_ARCHITECTURES)
# model types whose "sliding_attention" layers are attention layers with a window (model_config's layer-typed
# windows): LFM3's, Lara-4-Mini's
_SLIDING_KINDS = ("lfm3", "lara_mini")
# model types whose "indexed_attention" layers (sparse attention, dense up to model_config's limit) are full attention
_INDEXED_KINDS = ("qwen4_exp", "qwen4_exp_text")
_LINEAR, _FULL = ("linear_attention", "mamba", "conv"), ("full_attention", "attention")
ATTENTION_KINDS = ("linear_attention", "full_attention")
# NemotronH's hybrid_override_pattern: one character per layer
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def layer_types(hf_config, allowed: tuple[str, ...] = ATTENTION_KINDS) -> list[str]:
    """Each decoder layer's kind, one of `allowed` ("mamba", LFM2's "conv" and "attention", the older names, read
    as "linear_attention" and "full_attention"; NemotronH's "mlp" and "moe" where allowed): the config's
    `layer_types` (NemotronH: `layers_block_type`, or its `hybrid_override_pattern`; LFM2: its `full_attn_idxs`,
    the others conv), else, for a Gated DeltaNet config, every `full_attention_interval`-th layer (4 by default,
    transformers' rule for Qwen3-Next) full attention and the others linear; for another a ValueError."""
    types = getattr(hf_config, "layers_block_type", None) or getattr(hf_config, "layer_types", None)
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if not types and isinstance(pattern, str):
        types = [_PATTERN.get(ch, ch) for ch in pattern]
    full_idxs = getattr(hf_config, "full_attn_idxs", None)
    if not types and full_idxs is not None:
        types = ["full_attention" if i in full_idxs else "conv" for i in range(hf_config.num_hidden_layers)]
    if not types:
        if not hasattr(hf_config, "linear_num_value_heads"):  # only Qwen3-Next's rule derives a list
            raise ValueError("config.json names no layer_types (nor layers_block_type / hybrid_override_pattern)")
        interval = int(getattr(hf_config, "full_attention_interval", 4) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(hf_config.num_hidden_layers)]
    model_type = getattr(hf_config, "model_type", None)
    full = (_FULL + (("sliding_attention",) if model_type in _SLIDING_KINDS else ())
            + (("indexed_attention",) if model_type in _INDEXED_KINDS else ()))
    kinds = ["linear_attention" if k in _LINEAR else "full_attention" if k in full else k for k in types]
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - set(allowed):
        raise ValueError(f"config.json: the layer kinds {list(types)} must name {hf_config.num_hidden_layers} layers, "
                         f"each one of {allowed} (or 'mamba' / 'attention')")
    return kinds


def recurrent_layers(architecture: str, hf_config) -> tuple[int, ...]:
    """The decoder layers that keep a recurrent state instead of a KV cache (none for other architectures)."""
    if architecture not in (GATED_DELTANET_ARCHITECTURES + MAMBA2_ARCHITECTURES + SHORT_CONV_ARCHITECTURES
                            + MAMBA1_ARCHITECTURES + KDA_ARCHITECTURES + LIGHTNING_ARCHITECTURES
                            + INKLING_ARCHITECTURES):
        return ()
    if architecture in PARALLEL_HYBRID_ARCHITECTURES + ATTENTION_FREE_ARCHITECTURES + SHARED_BLOCK_ARCHITECTURES:
        return tuple(range(hf_config.num_hidden_layers))
    kinds = layer_types(hf_config, ATTENTION_KINDS + ("mlp", "moe"))  # the model refuses what it cannot build
    return tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")


def shared_block_layers(architecture: str, hf_config) -> tuple[int, ...]:
    """Zamba2's "hybrid" layers (`layers_block_type`: "hybrid" or Mamba-2 alone, "mamba" / "linear_attention"), each
    applying a shared attention block (with its own KV cache) before its mixer; () for other architectures."""
    if architecture not in SHARED_BLOCK_ARCHITECTURES:
        return ()
    kinds = list(getattr(hf_config, "layers_block_type", None) or [])
    if len(kinds) != hf_config.num_hidden_layers or set(kinds) - {"hybrid", "mamba", "linear_attention"}:
        raise ValueError(f"config.json: Zamba2's layers_block_type {kinds} must name {hf_config.num_hidden_layers} "
                         "layers, each 'hybrid' or 'mamba' / 'linear_attention'")
    return tuple(i for i, kind in enumerate(kinds) if kind == "hybrid")


@dataclass(frozen=True)
class RecurrentShape:
    """One linear layer's state per request: the last kernel - 1 inputs of its causal depthwise convolution over
    conv_dim channels (the model's dtype), and its recurrent state (fp32): Gated DeltaNet's [Hv, Dk, Dv] (conv
    channels q | k | v: 2 Hk Dk + Hv Dv), Mamba-2's [heads, head_dim, d_state] (channels x | B | C: heads x head_dim
    + 2 n_groups d_state); Lightning Attention's [H, D, D] without a convolution (kernel 1, no channels); LFM2's
    short convolution none (state_dims None; channels: its hidden size)."""

    conv_dim: int
    conv_kernel: int
    state_dims: tuple[int, int, int] | None

    @classmethod
    def of(cls, architecture: str, hf_config) -> RecurrentShape:
        if architecture in INKLING_ARCHITECTURES:  # k | v | attention out | MLP out histories, no recurrent matrix
            kernel = int(hf_config.conv_kernel_size)
            if kernel < 1:
                raise ValueError(f"config.json: conv_kernel_size={kernel} must be >= 1")
            return cls(inkling_conv_channels(hf_config), kernel, None)
        if architecture in SHORT_CONV_ARCHITECTURES:
            kernel = int(getattr(hf_config, "conv_L_cache", 3))
            if kernel < 1:
                raise ValueError(f"config.json: conv_L_cache={kernel} must be >= 1")
            return cls(int(hf_config.hidden_size), kernel, None)
        if architecture in MAMBA1_ARCHITECTURES:  # a head per channel of head_dim 1, its own A row of d_state
            m = Mamba1Settings.from_hf_config(hf_config)
            return cls(m.inner, m.d_conv, (m.inner, 1, m.d_state))
        if architecture in MAMBA2_ARCHITECTURES:
            m = Mamba2Settings.from_hf_config(hf_config)
            return cls(m.intermediate + 2 * m.n_groups * m.d_state, m.conv_kernel, (m.n_heads, m.head_dim, m.d_state))
        if architecture in KDA_ARCHITECTURES:  # q | k | v channels of H heads of D; the state [H, D, D]
            h, d, kernel = int(hf_config.linear_num_heads), int(hf_config.linear_head_dim), int(
                hf_config.linear_conv_kernel_dim)
            return cls(3 * h * d, kernel, (h, d, d))
        if architecture in LIGHTNING_ARCHITECTURES:  # no convolution (a kernel of 1: no history); the state [H, D, D]
            h = int(hf_config.num_attention_heads)
            d = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // h)
            return cls(0, 1, (h, d, d))
        hk, hv = int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads)
        dk, dv = int(hf_config.linear_key_head_dim), int(hf_config.linear_value_head_dim)
        kernel = int(hf_config.linear_conv_kernel_dim)
        if hv % hk or kernel < 1:
            raise ValueError(f"config.json: linear_num_value_heads={hv} must be a multiple of "
                             f"linear_num_key_heads={hk}, linear_conv_kernel_dim >= 1")
        return cls(2 * hk * dk + hv * dv, kernel, (hv, dk, dv))

    def for_rank(self, tp: int) -> RecurrentShape:
        """One tensor-parallel rank's share: its heads (the first state dim) and their convolution channels (every
        part of conv_dim splits evenly: resolve_hybrid_options checked the heads and groups)."""
        if self.state_dims is None:
            return RecurrentShape(self.conv_dim // tp, self.conv_kernel, None)
        a, b, c = self.state_dims
        return RecurrentShape(self.conv_dim // tp, self.conv_kernel, (a // tp, b, c))

    def conv_state_shape(self, slots: int) -> tuple[int, int, int]:
        return (slots, self.conv_kernel - 1, self.conv_dim)

    def recurrent_state_shape(self, slots: int) -> tuple[int, int, int, int]:
        return (slots, *self.state_dims)

    def slot_bytes(self, conv_itemsize: int) -> int:
        """Bytes of one request's state in one layer (the recurrent state in fp32)."""
        a, b, c = self.state_dims or (0, 0, 0)
        return (self.conv_kernel - 1) * self.conv_dim * conv_itemsize + a * b * c * 4


@dataclass(frozen=True)
class Mamba2Settings:
    """A Mamba-2 mixer's settings from its config keys (Granite 4.0-H's and Bamba's `mamba_*`, NemotronH's own names,
    Falcon-H1's `mamba_d_ssm` width): heads x head_dim = intermediate, n_groups groups of B / C of d_state each, a
    convolution of conv_kernel (with a bias: conv_bias), in_proj / out_proj biases (proj_bias; out_bias where the
    config names out_proj's apart: Falcon-H1's projectors_bias), the convolution's activation and the gated norm's
    eps."""

    n_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    act: str
    eps: float
    out_bias: bool | None = None  # None: proj_bias

    @property
    def out_proj_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    @property
    def intermediate(self) -> int:
        return self.n_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf_config) -> Mamba2Settings:
        c = hf_config
        if hasattr(c, "mamba_num_heads"):  # NemotronH: intermediate = heads x head_dim (its `expand` unused)
            m = cls(int(c.mamba_num_heads), int(c.mamba_head_dim), int(c.ssm_state_size), int(c.n_groups),
                    int(c.conv_kernel), bool(c.use_conv_bias), bool(getattr(c, "use_bias", False)),
                    getattr(c, "mamba_hidden_act", "silu"), float(c.layer_norm_epsilon))
            inter = m.intermediate
        elif getattr(c, "model_type", None) == "zamba2":  # transformers' Zamba2MambaMixer: the convolution biased
            # whatever use_conv_bias says, in_proj / out_proj biased as add_bias_linear, the gated norm's eps 1e-5
            inter, heads = int(c.mamba_expand * c.hidden_size), int(c.n_mamba_heads)
            m = cls(heads, inter // heads, int(c.mamba_d_state), int(c.mamba_ngroups), int(c.mamba_d_conv), True,
                    bool(c.add_bias_linear), "silu", 1e-5)
        elif getattr(c, "model_type", None) == "mamba2":  # Mamba-2 (mamba-codestral): intermediate = expand x hidden
            m = cls(int(c.num_heads), int(c.head_dim), int(c.state_size), int(c.n_groups), int(c.conv_kernel),
                    bool(c.use_conv_bias), bool(c.use_bias), getattr(c, "hidden_act", "silu"),
                    float(c.layer_norm_epsilon))
            inter = int(c.expand * c.hidden_size)
        elif hasattr(c, "mamba_d_ssm"):  # Falcon-H1: the width its own (its config class defaults it to 1024)
            ssm = getattr(c, "mamba_d_ssm", None)
            inter = int(ssm) if ssm is not None else int(getattr(c, "mamba_expand", 2) * c.hidden_size)
            heads, head_dim = int(c.mamba_n_heads), getattr(c, "mamba_d_head", "auto")
            m = cls(heads, inter // heads if head_dim in (None, "auto") else int(head_dim), int(c.mamba_d_state),
                    int(getattr(c, "mamba_n_groups", 1) or 1), int(getattr(c, "mamba_d_conv", 4)),
                    bool(getattr(c, "mamba_conv_bias", True)), bool(getattr(c, "mamba_proj_bias", False)),
                    getattr(c, "hidden_act", "silu"), float(c.rms_norm_eps),
                    out_bias=bool(getattr(c, "projectors_bias", False)))
        else:  # Granite 4.0-H, Bamba
            heads, inter = int(c.mamba_n_heads), int(getattr(c, "mamba_expand", 2) * c.hidden_size)
            head_dim = getattr(c, "mamba_d_head", "auto")
            m = cls(heads, inter // heads if head_dim in (None, "auto") else int(head_dim), int(c.mamba_d_state),
                    int(getattr(c, "mamba_n_groups", 1) or 1), int(getattr(c, "mamba_d_conv", 4)),
                    bool(getattr(c, "mamba_conv_bias", True)), bool(getattr(c, "mamba_proj_bias", False)),
                    getattr(c, "hidden_act", "silu"), float(c.rms_norm_eps))
        if m.intermediate != inter or m.n_heads % m.n_groups:
            raise ValueError(f"config.json: {m.n_heads} Mamba heads x {m.head_dim} must equal the intermediate size "
                             f"{inter}, and {m.n_groups} groups divide the heads")
        return m


@dataclass(frozen=True)
class Mamba1Settings:
    """A Mamba-1 mixer's settings: Jamba's `mamba_*` keys or Mamba's / FalconMamba's own: inner width, d_state, the
    convolution's width and bias, dt's rank, the projections' bias, and dt / B / C's RMS norms ("weighted": Jamba's,
    "weightless": FalconMamba's, "none": Mamba's) with their eps."""

    inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    norms: str
    eps: float

    @classmethod
    def from_hf_config(cls, hf_config) -> Mamba1Settings:
        c, hidden = hf_config, int(hf_config.hidden_size)
        jamba = hasattr(c, "mamba_d_state")
        rank = getattr(c, "mamba_dt_rank" if jamba else "time_step_rank", "auto")
        rank = math.ceil(hidden / 16) if rank in (None, "auto") else int(rank)
        if jamba:
            return cls(int(c.mamba_expand * hidden), int(c.mamba_d_state), int(c.mamba_d_conv), rank,
                       bool(c.mamba_conv_bias), bool(c.mamba_proj_bias), "weighted", float(c.rms_norm_eps))
        falcon = getattr(c, "model_type", None) == "falcon_mamba"
        inner = int(getattr(c, "intermediate_size", None) or c.expand * hidden)
        return cls(inner, int(c.state_size), int(c.conv_kernel), rank, bool(c.use_conv_bias), bool(c.use_bias),
                   "weightless" if falcon else "none", float(getattr(c, "mixer_rms_eps", 1e-6)))


def resolve_hybrid_options(config: Any) -> str | None:
    """EngineConfig's options for a model with recurrent layers (config.model_config.recurrent_layers): a request's
    state lives in its slot and advances with every token it runs, so what needs a state at an arbitrary earlier
    position is refused (speculative decoding's rejected drafts) or turned off (prefix caching, as vLLM: a cached
    prefix's state is not kept); tensor parallelism gives each rank whole heads (and Mamba-2 groups), so a size that
    does not divide them is refused. Returns why piecewise CUDA graphs do not fit such a model (their graphs split at
    attention only: layer_options makes its steps other than uniform decode run eagerly), None for another model."""
    mc = config.model_config
    if not mc.recurrent_layers:
        return None
    RecurrentShape.of(mc.architecture, mc.hf_config)  # its config errors now, not at load
    if mc.num_kv_layers == 0 and mc.architecture not in ATTENTION_FREE_ARCHITECTURES:
        raise ValueError(f"{mc.architecture} with no attention layer (every layer linear) is not supported (its "
                         "attention-free form: MambaForCausalLM, FalconMambaForCausalLM, Mamba2ForCausalLM)")
    name = f"{mc.architecture} (linear-attention layers {list(mc.recurrent_layers)})"
    if config.speculative_config is not None:
        raise ValueError(f"speculative decoding is not supported with {name}: a rejected draft would leave its "
                         "tokens in the recurrent state")
    tp = config.tensor_parallel_size
    if tp > 1:  # each rank takes its share of the heads (and of Mamba-2's groups of B / C)
        if mc.architecture in MAMBA1_ARCHITECTURES + ATTENTION_FREE_ARCHITECTURES:
            raise ValueError(f"tensor_parallel_size={tp} is not supported with {name} yet (Mamba-1 layers, "
                             "attention-free models)")
        if mc.architecture in SHARED_BLOCK_ARCHITECTURES:
            raise ValueError(f"tensor_parallel_size={tp} is not supported with {name} yet (Zamba2's shared blocks' "
                             "low-rank adapters are not split between ranks)")
        if mc.architecture in LIGHTNING_ARCHITECTURES:
            raise ValueError(f"tensor_parallel_size={tp} is not supported with {name} yet (Lightning Attention's "
                             "output norm spans every head)")
        if mc.architecture in MAMBA2_ARCHITECTURES:
            m = Mamba2Settings.from_hf_config(mc.hf_config)
            split = {"Mamba heads": m.n_heads, "Mamba groups (n_groups)": m.n_groups}
        elif mc.architecture in KDA_ARCHITECTURES:
            split = {"linear_num_heads": int(mc.hf_config.linear_num_heads)}
        elif mc.architecture in SHORT_CONV_ARCHITECTURES:
            split = {"hidden_size (the convolution's channels)": int(mc.hf_config.hidden_size)}
        else:
            split = {"linear_num_key_heads": int(mc.hf_config.linear_num_key_heads),
                     "linear_num_value_heads": int(mc.hf_config.linear_num_value_heads)}
        uneven = {k: v for k, v in split.items() if v % tp}
        if uneven:
            raise ValueError(f"tensor_parallel_size={tp} must divide the linear layers' {uneven} of {name} (each "
                             "rank runs whole heads and groups; replicated groups are not built)")
    if config.enable_prefix_caching:
        logger.warning("prefix caching is off for %s: a cached prefix's recurrent state is not kept", name)
        config.enable_prefix_caching = False
    return f"{name}: its linear-attention layers run eagerly outside uniform decode steps"
