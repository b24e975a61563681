"""Ground floor: RopeSettings, the rotary embedding's settings read from a HF config, and what follows from them
(inverse frequencies, the cos/sin scale, the longest position the model takes).

Rope types: "default", "llama3" (Llama 3.1's frequency bands), "linear" (positions / factor) and "yarn" (YaRN:
frequencies blended between interpolation and extrapolation per dimension, cos/sin scaled by an attention factor;
Qwen2.5/Qwen3's long-context recipe). Each computes what transformers' `modeling_rope_utils` computes for it
(tests/models/test_rope_scaling.py compares logits with transformers' models). Any other type ("dynamic",
"longrope", ...) is refused with a ValueError, never ignored. Imports no folder of the package."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeSettings:
    theta: float
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn (the pretraining context)
    attention_factor: float = 1.0  # yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the ramp's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards to whole dimensions

    @classmethod
    def from_hf_config(cls, hf_config) -> RopeSettings:
        """transformers >= 5 keeps everything in `rope_parameters`; older configs use `rope_theta` and
        `rope_scaling` attributes. Both are accepted; other rope types are rejected, never ignored."""
        params = dict(getattr(hf_config, "rope_parameters", None) or {})
        legacy = dict(getattr(hf_config, "rope_scaling", None) or {})
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        if theta is None:
            theta = 10000.0  # transformers' default for Llama/Qwen configs that omit it
        scaling = params if params.get("rope_type", params.get("type", "default")) != "default" else legacy
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        if rope_type == "default":
            return cls(theta=float(theta))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: "
                             f"{', '.join(repr(t) for t in ROPE_TYPES)}")
        try:
            if rope_type == "llama3":
                return cls(theta=float(theta), rope_type="llama3", factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
            if rope_type == "linear":
                return cls(theta=float(theta), rope_type="linear", factor=_positive(scaling["factor"], "factor"))
            return cls._yarn(float(theta), scaling, hf_config)
        except KeyError as e:
            raise ValueError(f"{rope_type} rope scaling is missing {e.args[0]!r}") from None

    @classmethod
    def _yarn(cls, theta: float, scaling: dict, hf_config) -> RopeSettings:
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
                   beta_slow=float(scaling.get("beta_slow") or 1), truncate=bool(scaling.get("truncate", True)))

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
        """[head_dim // 2] fp32 inverse frequencies (on the current default device)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        pos_freqs = self.theta**exponents
        inv_freq = 1.0 / pos_freqs
        if self.rope_type == "llama3":
            inv_freq = self._llama3_scale(inv_freq)
        elif self.rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif self.rope_type == "yarn":
            inv_freq = self._yarn_blend(pos_freqs, head_dim)
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


def _positive(value, name: str) -> float:
    value = float(value)
    if not value > 0:
        raise ValueError(f"rope scaling {name} must be > 0, got {value}")
    return value
