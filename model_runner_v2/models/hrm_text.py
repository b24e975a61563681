"""HRM-Text (`HrmTextForCausalLM`: Sapient's HRM-Text-1B), as transformers computes it: two stacks of n Llama
layers (`L_module`, `H_module`, n = `num_layers_per_stack`) applied again and again over the model's depth, never
over time — per token nothing carries from one step to the next but the KV caches:

    zH = embed(ids) * embedding_scale;  zL = z_L_init
    H_cycles times:  L_cycles times zL = L(zL + zH);  then zH = H(zH + zL)
    logits = lm_head(zH)

A stack's pass is its n layers, then its weightless final norm. Every application of a layer is its own KV layer
(slot): L layer i in L-visit l of H-cycle h at ((h * (L_cycles + 1) + l) * n + i), H layer i at ((h * (L_cycles + 1)
+ L_cycles) * n + i), transformers' cache order; the config's `num_hidden_layers` counts the slots (its class derives
it). Each physical attention holds one parameter-free Attention per slot it serves. The sum entering a stack is the
deferred residual add of its first layer's norm (a stack is called with x = the other stream, residual = its own).

Layers: weightless RMSNorms (Llama's order, no weight), multi-head attention (K/V heads = q heads whatever a config
says), the rotary over whole heads, the output gated per element by sigmoid(gate_proj(normed input)) before o_proj
(`self_attn.gate_proj` -> `o_gate`), a SwiGLU MLP. The files fuse `attn.gqkv_proj` ([gate | q | k | v] rows) and
`mlp.gate_up_proj` (transformers' conversion; its in-memory names load too). Served causally: transformers' prefix-LM
mode needs `token_type_ids`, which no request carries (transformers without them computes what the engine does)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import sigmoid
from ...model_config import position_limit
from ...rope_settings import RopeSettings
from ..attention import Attention
from .decoder import DecoderAttention, DecoderLayer, DecoderLM, DecoderMLP, DecoderSpec
from .layers import RotaryEmbedding
from .llama4 import WeightlessRMSNorm
from .parallel import ColumnParallelLinear, attach_lm_head, embedding


def hrm_slots(hf_config) -> tuple[int, int, int, int]:
    """(layers per stack n, H_cycles, L_cycles, KV slots n * H_cycles * (L_cycles + 1))."""
    n = int(getattr(hf_config, "num_layers_per_stack", None) or hf_config.num_hidden_layers)
    h, low = int(hf_config.H_cycles), int(hf_config.L_cycles)
    if min(n, h, low) < 1:
        raise ValueError(f"config.json: HRM-Text needs positive num_layers_per_stack, H_cycles and L_cycles, got "
                         f"{n}, {h}, {low}")
    return n, h, low, n * h * (low + 1)


class HrmAttention(DecoderAttention):
    """Gated multi-head attention serving several KV slots: `visits[v]` is the Attention of its v-th application
    (its slot's cache); the model sets `visit` before each pass of the layer's stack."""

    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, spec: DecoderSpec, slots: list[int], rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, slots[0], rotary)
        total = hf_config.num_attention_heads * self.head_dim
        self.o_gate = ColumnParallelLinear(hf_config.hidden_size, [total], bias=spec.qkv_bias)
        a = self.attn
        self.visits = nn.ModuleList(Attention(s, a.num_heads, a.num_kv_heads, a.head_dim, a.scale) for s in slots)
        del self.attn
        self.visit = 0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        q, k, v = self.qkv_proj(normed).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.visits[self.visit](positions, q, k, v, self.rotary)  # [T, Hq * D]
        return self.o_proj(out * sigmoid(self.o_gate(normed), self.batch_invariant)), residual


class HrmLayer(DecoderLayer):
    def __init__(self, hf_config, spec: DecoderSpec, slots: list[int], rotary: RotaryEmbedding):
        nn.Module.__init__(self)
        self.self_attn = HrmAttention(hf_config, spec, slots, rotary)
        self.mlp = DecoderMLP(hf_config, spec)
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return WeightlessRMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))


class HrmStack(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, slots: list[list[int]], rotary: RotaryEmbedding):
        """slots[i]: layer i's KV slots in the order of the stack's visits."""
        super().__init__()
        self.layers = nn.ModuleList(HrmLayer(hf_config, spec, s, rotary) for s in slots)
        self.final_norm = HrmLayer.make_norm(hf_config)

    def forward(self, visit: int, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The stack over x + residual (the add inside its first norm) in its `visit`-th application -> [T, H]."""
        for layer in self.layers:
            layer.self_attn.visit = visit
            x, residual = layer(positions, x, residual)
        return self.final_norm.add_and_norm(x, residual)[0]


class HrmTextModel(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec):
        super().__init__()
        n, self.h_cycles, self.l_cycles, slots = hrm_slots(hf_config)
        if hf_config.num_hidden_layers != slots:  # transformers' config class derives it; a file may not say so
            raise ValueError(f"config.json: HRM-Text's num_hidden_layers={hf_config.num_hidden_layers} is not its KV "
                             f"slots' count {slots} (num_layers_per_stack x H_cycles x (L_cycles + 1))")
        per_cycle = self.l_cycles + 1
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.embedding_scale = float(getattr(hf_config, "embedding_scale", None)
                                     or 1.0 / float(hf_config.initializer_range))
        self.z_L_init = nn.Parameter(torch.empty(hf_config.hidden_size), requires_grad=False)
        rope = RopeSettings.from_hf_config(hf_config)
        rotary = RotaryEmbedding(int(hf_config.head_dim), rope.max_positions(position_limit(hf_config)), rope)
        low = [[(h * per_cycle + v) * n + i for h in range(self.h_cycles) for v in range(self.l_cycles)]
               for i in range(n)]
        high = [[(h * per_cycle + self.l_cycles) * n + i for h in range(self.h_cycles)] for i in range(n)]
        self.L_module = HrmStack(hf_config, spec, low, rotary)
        self.H_module = HrmStack(hf_config, spec, high, rotary)

    @property
    def layers(self) -> list[HrmLayer]:
        """Both stacks' physical layers (DecoderLM._fused_shards reads their projections)."""
        return [*self.L_module.layers, *self.H_module.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        z_h = self.embed_tokens(input_ids) * self.embedding_scale  # [T, H]
        z_l = self.z_L_init.expand_as(z_h).contiguous()
        for h in range(self.h_cycles):
            for v in range(self.l_cycles):
                z_l = self.L_module(h * self.l_cycles + v, positions, z_l, z_h)
            z_h = self.H_module(h, positions, z_h, z_l)
        return z_h


class HrmTextForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
                           qk_norm=False, num_kv_heads=int(hf_config.num_attention_heads))

    def __init__(self, hf_config):
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = HrmTextModel(hf_config, self.spec(hf_config))
        attach_lm_head(self, hf_config)

    def enable_fp32_lm_head(self) -> None:
        if self.model.embed_tokens.weight.dtype != torch.float32:
            raise ValueError("HRM-Text: enable_fp32_lm_head is not supported (its last norm ends a stack's pass)")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = name.replace(".attn.", ".self_attn.").replace(".self_attn.gate_proj.", ".self_attn.o_gate.")
        if name.endswith(".self_attn.gqkv_proj.weight"):  # [gate | q | k | v] rows, nH * D each
            prefix = name[: -len("gqkv_proj.weight")]
            parts = ("o_gate", "q_proj", "k_proj", "v_proj")
            return [(f"{prefix}{p}.weight", t) for p, t in zip(parts, tensor.chunk(4, dim=0))]
        if name.endswith(".mlp.gate_up_proj.weight"):  # [gate | up]: the engine's own fused layout
            prefix = name[: -len("gate_up_proj.weight")]
            return [(f"{prefix}{p}.weight", t) for p, t in zip(("gate_proj", "up_proj"), tensor.chunk(2, dim=0))]
        return ((name, tensor),)
