"""Ground floor: RopeSettings, the rotary embedding's settings read from a HF config, and what follows from them
(inverse frequencies, the cos/sin scale, the longest position the model takes).

Rope types: "default", "llama3" (Llama 3.1's frequency bands), "linear" (positions / factor), "yarn" (YaRN:
frequencies blended between interpolation and extrapolation per dimension, cos/sin scaled by an attention factor;
Qwen2.5/Qwen3's long-context recipe) and "longrope" (Phi-3.5 / Phi-4-mini: per-frequency short or long factors,
cos/sin scaled), and HunYuan's "dynamic" with a fixed `alpha` ("ntk_alpha": the base stretched to
theta * alpha ** (d / (d - 2)), d the rotary width: static frequencies, as transformers' HunYuan classes read it),
and "dynamic" (dynamic NTK: transformers' frequencies for sequences within `max_position_embeddings` — its base
formula at that length, the default frequencies up to float rounding of the formula — the engine's limit for it:
transformers stretches the base past it, vLLM stretches it everywhere).
Each computes what transformers' `modeling_rope_utils` computes for it
(tests/models/test_rope_scaling.py compares logits with transformers' models). Any other type ("dynamic", ...) is
refused with a ValueError, never ignored. A `partial_rotary_factor` < 1 rotates the first
int(head_dim * factor) elements of each head (`rotary_dim`); with the default rope type only in the model types
whose transformers rotary reads it (`READS_PARTIAL_FACTOR`): Llama's, Qwen's, Mistral's, Gemma's ... rotate the
whole head whatever the config says (vLLM's Llama honours it: transformers, this engine's reference, does not).
Imports no folder of the package."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "dynamic", "proportional")  # and HunYuan's ntk_alpha
# The model types whose transformers (5.25) default rotary reads partial_rotary_factor (the compute_default_rope_
# parameters of their modeling file, or of the class transformers runs them as: Sarvam / Param2 as GLM-4-MoE): in
# any other, a "default" rope rotates the whole head.
READS_PARTIAL_FACTOR = frozenset((
    "bamba", "deepseek_v4", "diffusion_gemma", "diffusion_gemma_text", "dots3_note", "dots3_note_text", "glm", "glm4",
    "glm4_moe", "glm4_moe_lite", "glm4v", "glm4v_moe", "glm4v_moe_text", "glm4v_text", "glm_image", "glm_image_text",
    "glm_ocr", "glm_ocr_text", "gpt_neox", "gpt_neox_japanese", "laguna", "mellum", "mimo_v2_flash", "minimax_m2",
    "minimax_m3_vl", "minimax_m3_vl_text", "nemotron", "neomme", "param2moe", "persimmon", "phi", "phi3",
    "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next", "qwen4_exp",
    "qwen4_exp_text", "recurrent_gemma", "sarvam_moe", "solar_open", "stablelm", "step3p5", "step3p7", "zaya"))


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn: the pretraining context; dynamic: max_position_embeddings
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards to whole dimensions
    partial_rotary_factor: float = 1.0  # the share of each head that rotates (rotary_dim)
    short_factor: tuple[float, ...] = ()  # longrope: each frequency's divisor within the pretraining context
    long_factor: tuple[float, ...] = ()  # longrope: ... beyond it
    use_long_factor: bool = False  # longrope: the long factors (for_context: max_model_len > the original context)
    alpha: float = 1.0  # ntk_alpha (HunYuan): the base is theta * alpha ** (d / (d - 2))
    short_mscale: float = 0.0  # longrope (Phi-3.5-MoE): the cos/sin scale with the short / long factors (0: none)
    long_mscale: float = 0.0
    proportion: float = 1.0  # proportional (Gemma 4's full layers): the share of the head's pairs that rotate

    @classmethod
    def from_hf_config(cls, hf_config, default_partial_rotary_factor: float = 1.0,
                       layer_type: str = "full_attention") -> RopeSettings:
        """transformers >= 5 keeps everything in `rope_parameters`; older configs use `rope_theta` and
        `rope_scaling` attributes. Both are accepted; other rope types are rejected, never ignored. A config that
        names no partial_rotary_factor gets the architecture's default (GLM's config classes set 0.5). A config
        whose rope_parameters are per layer type (Gemma 3: {"full_attention": {...}, "sliding_attention":
        {...}}) gives `layer_type`'s (a missing one is refused)."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        kinds = [v for v in params.values() if isinstance(v, dict)]
        if kinds and all(isinstance(v, dict) or v is None for v in params.values()):  # per layer type
            if layer_type not in params:
                raise ValueError(f"rope_parameters has no {layer_type!r} entry (it has {sorted(params)})")
            # None: that kind of layer rotates nothing (Beam's, Ergo's full layers; their model files say so); the
            # first kind's settings stand in (the table such layers never read, the position limit)
            params = dict(params[layer_type] if params[layer_type] is not None else kinds[0])
        legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        if theta is None:
            theta = 10000.0  # transformers' default for Llama/Qwen configs that omit it
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else legacy
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
        if rope_type == "default" and getattr(hf_config, "model_type", None) not in READS_PARTIAL_FACTOR:
            partial = None  # transformers' rotary of this model type rotates the whole head (the module docstring)
        partial = _partial_factor(default_partial_rotary_factor if partial is None else partial)
        if rope_type == "default":
            return cls(theta=float(theta), partial_rotary_factor=partial)
        if (rope_type == "dynamic" and scaling.get("alpha")
                and str(getattr(hf_config, "model_type", "")).startswith("hunyuan")):
            return cls(theta=float(theta), rope_type="ntk_alpha", alpha=_positive(scaling["alpha"], "alpha"),
                       partial_rotary_factor=partial)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(repr(t) for t in ROPE_TYPES)}")
        try:
            if rope_type == "llama3":
                return cls(theta=float(theta), rope_type="llama3", factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                           partial_rotary_factor=partial)
            if rope_type == "linear":
                return cls(theta=float(theta), rope_type="linear", factor=_positive(scaling["factor"], "factor"),
                           partial_rotary_factor=partial)
            if rope_type == "longrope":
                return cls._longrope(float(theta), scaling, hf_config, partial)
            if rope_type == "proportional":  # the whole head in the rotation, its later pairs at frequency 0
                return cls(theta=float(theta), rope_type="proportional", factor=_positive(scaling.get("factor", 1.0),
                                                                                          "factor"),
                           proportion=_partial_factor(partial))
            if rope_type == "dynamic":
                return cls(theta=float(theta), rope_type="dynamic", factor=_positive(scaling["factor"], "factor"),
                           original_max_position_embeddings=int(hf_config.max_position_embeddings),
                           partial_rotary_factor=partial)
            return cls._yarn(float(theta), scaling, hf_config, partial)
        except KeyError as e:
            raise ValueError(f"{rope_type} rope scaling is missing {e.args[0]!r}") from None

    @classmethod
    def _longrope(cls, theta: float, scaling: dict, hf_config, partial: float) -> RopeSettings:
        """transformers' `_compute_longrope_parameters` rules: the pretraining context from the scaling dict or the
        config (Phi-3 keeps it at the top level); a null factor is max_position_embeddings / that context; a null
        attention factor is sqrt(1 + ln(factor) / ln(context)), 1 for factor <= 1. Both factor lists are kept:
        which one applies is decided by the served context (for_context)."""
        original = scaling.get("original_max_position_embeddings") or getattr(
            hf_config, "original_max_position_embeddings", None)
        if not original:
            raise KeyError("original_max_position_embeddings")
        original = int(original)
        factor = scaling.get("factor")
        factor = _positive(hf_config.max_position_embeddings / original if factor is None else factor, "factor")
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short, long = (tuple(float(f) for f in scaling[name]) for name in ("short_factor", "long_factor"))
        # Phi-3.5-MoE names the scale per factor list (transformers' Phimoe rotary: short_mscale, long_mscale)
        mscales = [float(scaling.get(name) or 0.0) for name in ("short_mscale", "long_mscale")]
        if any(mscales) and not all(m > 0 for m in mscales):
            raise ValueError(f"longrope short_mscale / long_mscale must both be > 0, got {mscales}")
        return cls(theta=theta, rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                   attention_factor=mscales[0] or float(attention), partial_rotary_factor=partial,
                   short_factor=short, long_factor=long, short_mscale=mscales[0], long_mscale=mscales[1])

    def for_context(self, max_model_len: int) -> RopeSettings:
        """These settings for an engine serving sequences up to max_model_len tokens. Only longrope depends on
        it, and it takes vLLM's rule: the long factors for every position when max_model_len exceeds the
        pretraining context, else the short ones. transformers picks per forward from the sequence's own length,
        so the two agree on every sequence of an engine whose max_model_len is within the pretraining context,
        and on sequences longer than it otherwise (docs/features.md)."""
        if self.rope_type != "longrope":
            return self
        long = max_model_len > self.original_max_position_embeddings
        scale = self.long_mscale if long else self.short_mscale
        return replace(self, use_long_factor=long, attention_factor=scale or self.attention_factor)

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's elements rotate (transformers' int(head_dim * partial_rotary_factor)); even."""
        dim = int(head_dim * self.partial_rotary_factor)
        if dim < 2 or dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} of head_dim={head_dim} gives "
                             f"rotary_dim={dim}; it must be even and at least 2")
        return dim

    @classmethod
    def _yarn(cls, theta: float, scaling: dict, hf_config, partial: float = 1.0) -> RopeSettings:
        """transformers' `_compute_yarn_parameters` rules: the pretraining context defaults to
        max_position_embeddings, a null factor is max_position_embeddings / that context, and a null attention
        factor is 0.1 ln(factor) + 1 (or the ratio of two such terms with mscale and mscale_all_dim)."""
        max_pos = int(hf_config.max_position_embeddings)
        original = int(scaling.get("original_max_position_embeddings")
                       or getattr(hf_config, "original_max_position_embeddings", None) or max_pos)
        factor = scaling.get("factor")
        factor = _positive(max_pos / original if factor is None else factor, "factor")
        attention = scaling.get("attention_factor")
        if attention is None:
            mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention = _yarn_mscale(factor)
        return cls(theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                   attention_factor=float(attention), beta_fast=float(scaling.get("beta_fast") or 32),
                   beta_slow=float(scaling.get("beta_slow") or 1), truncate=bool(scaling.get("truncate", True)),
                   partial_rotary_factor=partial)

    def max_positions(self, max_position_embeddings: int) -> int:
        """The longest sequence the model takes with this scaling (vLLM's rule): linear stretches the config's
        max_position_embeddings by `factor`, yarn the pretraining context by `factor` (never below the config's
        own limit); default and llama3 keep it."""
        if self.rope_type == "linear":
            return max(max_position_embeddings, int(max_position_embeddings * self.factor))
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] fp32 inverse frequencies (on the current default device); `head_dim` is the rotary
        width (rotary_dim) where only part of each head rotates, as transformers' `dim`."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        base = self.theta
        if self.rope_type == "ntk_alpha":
            base = self.theta * self.alpha ** (head_dim / (head_dim - 2))
        elif self.rope_type == "dynamic":  # transformers' formula at seq_len = max_position_embeddings (P)
            p = self.original_max_position_embeddings
            base = self.theta * ((self.factor * p / p) - (self.factor - 1)) ** (head_dim / (head_dim - 2))
        pos_freqs = base**exponents
        inv_freq = 1.0 / pos_freqs
        if self.rope_type == "llama3":
            inv_freq = self._llama3_scale(inv_freq)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "proportional":  # transformers': the first int(proportion * D // 2) frequencies of
            # the whole head's D (not of a narrower rotary width), zeros after them (cos 1, sin 0: those elements
            # pass through bit for bit)
            rotating = int(self.proportion * head_dim // 2)
            inv_freq = torch.cat([inv_freq[:rotating], torch.zeros(head_dim // 2 - rotating)]) / self.factor
        elif self.rope_type == "yarn":
            inv_freq = self._yarn_blend(pos_freqs, head_dim)
        elif self.rope_type == "longrope":
            ext = self.long_factor if self.use_long_factor else self.short_factor
            if len(ext) != head_dim // 2:
                raise ValueError(f"longrope {'long' if self.use_long_factor else 'short'}_factor has {len(ext)} "
                                 f"entries; the rotary width {head_dim} needs {head_dim // 2}")
            inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * pos_freqs)
        return inv_freq

    def _llama3_scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed by `factor`,
        # those shorter than original / high_freq_factor are kept, and the band between is interpolated.
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(in_band, smoothed, scaled)

    def _yarn_blend(self, pos_freqs: torch.Tensor, head_dim: int) -> torch.Tensor:
        # YaRN: dimensions that turn more than beta_fast times over the pretraining context keep their frequency
        # (extrapolation), those under beta_slow turns are slowed by `factor` (interpolation), a linear ramp
        # between; the bounds are dimension indices, rounded outwards when `truncate`.
        def dim_of(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # no empty ramp
        ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolated = 1 - ramp  # [D/2] share of the unscaled frequency
        return (1.0 / (self.factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _partial_factor(value) -> float:
    value = float(value)
    if not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {value}")
    return value


def _positive(value, name: str) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"rope scaling {name} must be > 0, got {value}")
    return value
