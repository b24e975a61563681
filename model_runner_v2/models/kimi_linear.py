"""Kimi Linear (`KimiLinearForCausalLM`: Moonshot's Kimi-Linear-48B-A3B), as transformers' KimiLinear computes it: a
hybrid of Kimi Delta Attention layers ("linear_attention": a recurrent state per request, like Qwen3-Next's Gated
DeltaNet) and DeepSeek-V3's latent attention without any rotary ("full_attention": NoPE MLA, scale qk_head_dim^-0.5),
over DeepSeek-V3's MLP (`mlp_layer_types`: dense SwiGLU, or the sigmoid router with its correction, renormalised,
times `routed_scaling_factor`, plus the shared experts). Llama's pre-norm layers.

Kimi Delta Attention, per layer (H = linear_num_heads heads of D = linear_head_dim):
    q, k, v = silu(causal depthwise conv (width K, no bias) of [q_proj(x) | k_proj(x) | v_proj(x)])
    q = l2norm(q) * D^-0.5, k = l2norm(k) (fp32; l2norm(x) = x / sqrt(sum x^2 + 1e-6))
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)     [T, H, D] fp32: a decay per key channel
    beta = sigmoid(b_proj(x)) (the model dtype)
    the delta rule with S's row i decayed by exp(g[i]) (kernels/gated_delta.py, per-channel form)
    o = o_norm(o, g_b_proj(g_a_proj(x))): fp32 RMSNorm times its weight times sigmoid(gate), rounded; o_proj
The files name the forget gate's parts `self_attn.{f_a_proj, f_b_proj, dt_bias, A_log}` and the convolution
`self_attn.{q,k,v}_conv1d` (transformers: `self_attn.forget_gate.*`, one `conv1d`), the experts
`block_sparse_moe.experts.E.{w1, w3, w2}`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...hybrid_facts import layer_types
from ...kernels.activation import sigmoid, silu, softplus
from ...kernels.dispatch import use_fused_kernels
from ...kernels.gated_delta import delta_rule_torch, delta_rule_triton
from .decoder import DecoderMLP, DecoderSpec
from .deepseek import DeepseekV3ForCausalLM
from .gated_deltanet import ConvWeight
from .glm4_moe import Glm4MoeForCausalLM
from .layers import Linear, RMSNorm, RotaryEmbedding
from .mixtral import block_sparse_moe_name
from .mla import MlaAttention
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state, mark_sharded
from .recurrent_layer import RecurrentLayer
from .smollm3 import identity_rotary

_L2_EPS = 1e-6
_FORGET_GATE = ("f_a_proj", "f_b_proj", "dt_bias", "A_log")


class SigmoidGatedRMSNorm(nn.Module):
    """transformers' KimiLinearRMSNormGated: the row normalised in fp32, times the weight in fp32, times
    sigmoid(gate) in fp32, rounded once."""

    batch_invariant = False  # layers.set_batch_invariant: the sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * sigmoid(gate.float(), self.batch_invariant)).to(x.dtype)


class KimiDeltaAttention(RecurrentLayer):
    def __init__(self, hf_config):
        super().__init__()
        hidden, tp = hf_config.hidden_size, get_tp_state()
        heads, d = int(hf_config.linear_num_heads), int(hf_config.linear_head_dim)
        self.num_heads, self.head_dim = divide(heads, tp.size, "linear_num_heads"), d
        self.width, width = self.num_heads * d, heads * d  # this rank's channels of q (k, v), all ranks'
        self.q_proj, self.k_proj, self.v_proj = (ColumnParallelLinear(hidden, [width]) for _ in range(3))
        self.conv1d = ConvWeight(3 * self.width, int(hf_config.linear_conv_kernel_dim))
        self.forget_gate = nn.Module()
        self.forget_gate.f_a_proj = Linear(hidden, d)
        self.forget_gate.f_b_proj = ColumnParallelLinear(d, [width])
        self.forget_gate.dt_bias = nn.Parameter(torch.empty(self.width, dtype=torch.float32), requires_grad=False)
        self.forget_gate.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.b_proj = ColumnParallelLinear(hidden, [heads])
        self.g_a_proj, self.g_b_proj = Linear(hidden, d), ColumnParallelLinear(d, [width])
        self.o_norm = SigmoidGatedRMSNorm(d, float(hf_config.rms_norm_eps))
        self.o_proj = RowParallelLinear(width, hidden, bias=False)
        if tp.size > 1:
            mark_sharded(self.conv1d.weight, 0, tp, 3 * width, [width] * 3)
            mark_sharded(self.forget_gate.dt_bias, 0, tp, width)
            mark_sharded(self.forget_gate.A_log, 0, tp, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] (normed) -> [T, H]
        md, pos_start = self.step()
        t, h, d, inv = x.shape[0], self.num_heads, self.head_dim, self.batch_invariant
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        q, k, v = silu(self.conv(mixed, md, pos_start, self.conv1d.weight), inv).split([self.width] * 3, dim=-1)
        q = _l2norm(q.reshape(t, h, d).float()) * d**-0.5
        k = _l2norm(k.reshape(t, h, d).float())
        g = self.decay(x)  # [T, H, D] fp32
        beta = sigmoid(self.b_proj(x), inv).float()  # [T, H]: the sigmoid in the model dtype
        rule = delta_rule_triton if use_fused_kernels(x.device) else delta_rule_torch
        o = rule(q, k, v.reshape(t, h, d).float(), g.contiguous(), beta.contiguous(), self.state, md.req_slots,
                 md.query_start_loc, pos_start, md.max_query_len)  # [T, H, D] fp32
        o = self.o_norm(o.to(x.dtype), self.output_gate(x).view(t, h, d))
        return self.o_proj(o.reshape(t, self.width))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> g [T, H, D] fp32: the log decay of each key channel."""
        gate = self.forget_gate
        u = (gate.f_b_proj(gate.f_a_proj(x)).float() + gate.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        return -gate.A_log.float().exp()[:, None] * softplus(u, True)  # transformers' where(u > 20, u, log(1 + e^u))

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H * D], o_norm's gate
        return self.g_b_proj(self.g_a_proj(x))

    def shards(self) -> dict[str, tuple[str, int, int]]:
        """The files' per-part convolutions (q_conv1d, k_conv1d, v_conv1d) -> rows of this rank's conv1d."""
        return {f"{p}_conv1d": ("conv1d", i * self.width, self.width) for i, p in enumerate("qkv")}


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


class KimiLinearLayer(nn.Module):
    linear_class: type[KimiDeltaAttention] = KimiDeltaAttention  # the "linear_attention" layers' (Ling 3: its own)
    full_class: type[MlaAttention] = MlaAttention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        kinds = layer_types(hf_config)
        if kinds[layer_idx] == "linear_attention":
            self.self_attn = self.linear_class(hf_config)
        else:  # its KV cache: the full-attention layers' count before it
            self.self_attn = self.full_class(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary)
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.self_attn, KimiDeltaAttention):
            x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm.add_and_norm(
                x, residual)
            x = self.self_attn(x)
        else:
            x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        if isinstance(self.mlp, DecoderMLP):
            return self.mlp(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    layer_class = KimiLinearLayer
    checkpoint_fp32_suffixes = (*DeepseekV3ForCausalLM.checkpoint_fp32_suffixes, ".forget_gate.dt_bias")
    forget_gate_parts = _FORGET_GATE  # the files' names of the forget gate's parts, under self_attn
    nope_mla = True  # the latent attention without a rotary

    def __init__(self, hf_config):
        super().__init__(hf_config)
        mla = [layer.self_attn for layer in self.model.layers if isinstance(layer.self_attn, MlaAttention)]
        if mla and self.nope_mla:
            identity = identity_rotary(mla[0].rotary, same_layout=True)  # its latent attention has no rope
            for attn in mla:
                attn.rotary = identity

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = block_sparse_moe_name(name)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and isinstance(
                self.model.layers[int(parts[2])].self_attn, KimiDeltaAttention) and parts[3] == "self_attn":
            if parts[4] in self.forget_gate_parts:
                name = ".".join(parts[:4] + ["forget_gate"] + parts[4:])
            if parts[-1] == "A_log":
                tensor = tensor.reshape(-1)  # [1, 1, H, 1]
            return Glm4MoeForCausalLM.checkpoint_parts(self, name, tensor)  # (DeepSeek's q-row order is MLA's)
        return super().checkpoint_parts(name, tensor)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        shards = super()._fused_shards()
        kda = next((layer.self_attn for layer in self.model.layers if isinstance(layer.self_attn,
                                                                               KimiDeltaAttention)), None)
        return {**shards, **(kda.shards() if kda is not None else {})}
