"""Falcon-H1 (`FalconH1ForCausalLM`: tiiuae's Falcon-H1 0.5B / 1.5B / 3B / 7B / 34B, Falcon-H1R), as transformers
computes it: every layer runs attention and a Mamba-2 mixer side by side on one normed input and adds their
outputs (so each layer keeps a KV cache and a recurrent state: docs/hybrid_models.md), then a SwiGLU MLP:
    h = input_layernorm(x)
    x = x + (mamba(h * ssm_in) * ssm_out + attn(h * attention_in) * attention_out)
    x = x + down(up(h2) * silu(gate(h2) * mlp_multipliers[0])) * mlp_multipliers[1],  h2 = pre_ff_layernorm(x)
with its muP multipliers applied to the activations where transformers applies them (so bf16 rounds alike): the
attention's k times `key_multiplier` before the rotation and the cache; the mixer's in_proj output times
`ssm_multipliers`' five factors, one per part (z | x | B | C | dt); the embeddings times `embedding_multiplier`,
the logits times `lm_head_multiplier`. The mixer (mamba2.py's) is `mamba_d_ssm` wide; its gated norm only where
`mamba_rms_norm` (the group norm's weight in fp32, before the gate where `mamba_norm_before_gate`, else after), else
y * silu(z). Weights: `feed_forward.*` the MLP, `pre_ff_layernorm` the norm before it, `model.final_layernorm` the
final norm; in_proj's bias `mamba_proj_bias`, out_proj's `projectors_bias`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import silu
from .decoder import DecoderAttention, DecoderLayer, DecoderLM, DecoderSpec
from .hybrid_layer import feed_forward_names
from .layers import RotaryEmbedding
from .mamba2 import GroupedGatedRMSNorm, Mamba2Mixer
from .parallel import get_tp_state, mark_sharded


def _multipliers(hf_config, name: str, count: int) -> list[float]:
    values = [float(v) for v in (getattr(hf_config, name, None) or [1.0] * count)]
    if len(values) != count:
        raise ValueError(f"config.json: {name} must have {count} entries, got {values}")
    return values


class FalconGatedNorm(GroupedGatedRMSNorm):
    """transformers' FalconH1RMSNormGated over y [T, I] fp32 and z [T, I]: per group of I / G channels, y (times
    silu(z) first unless norm_before_gate) divided by its RMS, times the weight in fp32, then (norm_before_gate)
    times silu(z); cast once."""

    def __init__(self, dim: int, group: int, eps: float, norm_before_gate: bool):
        super().__init__(dim, group, eps)
        self.norm_before_gate = norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = silu(z.float(), self.batch_invariant)
        v = y.float() if self.norm_before_gate else y.float() * gate
        g = v.view(v.shape[0], -1, self.group)
        g = self.weight.view(-1, self.group) * (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps))
        v = g.view_as(v)
        return (v * gate if self.norm_before_gate else v).to(z.dtype)


class FalconH1Mixer(Mamba2Mixer):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        d, tp = self.dims, get_tp_state()
        self.ssm_in = float(getattr(hf_config, "ssm_in_multiplier", 1.0))
        self.ssm_out = float(getattr(hf_config, "ssm_out_multiplier", 1.0))
        gn = d.n_groups * d.d_state
        sizes = (d.intermediate, d.intermediate, gn, gn, d.n_heads)  # this rank's z | x | B | C | dt
        factors = _multipliers(hf_config, "ssm_multipliers", 5)
        self.register_buffer("mup", torch.cat([torch.full((n,), f) for n, f in zip(sizes, factors)]),
                             persistent=False)  # the model's dtype, as transformers' buffer after the cast
        self.norm = None
        if getattr(hf_config, "mamba_rms_norm", False):
            self.norm = FalconGatedNorm(d.intermediate, d.intermediate // d.n_groups, d.eps,
                                        bool(getattr(hf_config, "mamba_norm_before_gate", True)))
            if tp.size > 1:
                mark_sharded(self.norm.weight, 0, tp, d.intermediate * tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] (normed) -> [T, hidden]
        y, z = self.scan(self.in_proj(x * self.ssm_in) * self.mup)
        if self.norm is None:
            y = (y * silu(z, self.batch_invariant)).to(z.dtype)  # transformers: silu in the model dtype, fp32 product
        else:
            y = self.norm(y, z)
        return self.out_proj(y) * self.ssm_out


class FalconH1Attention(DecoderAttention):
    """Llama's attention on h * attention_in_multiplier, k times key_multiplier before the rotation, the output
    times attention_out_multiplier."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        self.in_mult = float(getattr(hf_config, "attention_in_multiplier", 1.0))
        self.key_mult = float(getattr(hf_config, "key_multiplier", 1.0))
        self.out_mult = float(getattr(hf_config, "attention_out_multiplier", 1.0))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] (normed) -> [T, H]
        q, k, v = self.qkv_proj(x * self.in_mult).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k * self.key_mult, v, self.rotary)) * self.out_mult


class FalconH1Layer(DecoderLayer):
    attention_class = FalconH1Attention
    batch_invariant = False  # layers.set_batch_invariant: the MLP's SiLU from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)  # its Attention's layer_idx: every layer caches
        self.mamba = FalconH1Mixer(hf_config)
        self.gate_mult, self.down_mult = _multipliers(hf_config, "mlp_multipliers", 2)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        mixed = self.mamba(h) + self.self_attn(positions, h)  # module calls: hooks see each branch's output
        h, residual = self.post_attention_layernorm.add_and_norm(mixed, residual)
        gate, up = self.mlp.gate_up_proj(h).chunk(2, dim=-1)
        return self.mlp.down_proj(up * silu(gate * self.gate_mult, self.batch_invariant)) * self.down_mult, residual


class FalconH1ForCausalLM(DecoderLM):
    layer_class = FalconH1Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        attention, mlp = bool(getattr(hf_config, "attention_bias", False)), bool(getattr(hf_config, "mlp_bias", False))
        return DecoderSpec(qkv_bias=attention, o_bias=attention, mlp_bias=mlp, qk_norm=False)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        embed = float(getattr(hf_config, "embedding_multiplier", 1.0))
        self.model.embed_scale = None if embed == 1.0 else embed
        self.lm_head_multiplier = float(getattr(hf_config, "lm_head_multiplier", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.lm_head_multiplier == 1.0 else logits * self.lm_head_multiplier

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(".mamba.mup_vector"):
            return ()  # computed from the config (transformers' buffer is not saved either)
        return ((feed_forward_names(name), tensor),)
