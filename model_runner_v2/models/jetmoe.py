"""JetMoE (`JetMoeForCausalLM`: jetmoe-8b), as transformers' JetMoe computes it: Llama's pre-norm layers (their two
norms at eps 1e-6 whatever the config says; the final one at `rms_norm_eps`) whose attention and MLP are both
mixtures of `num_local_experts`, each token routed to `num_experts_per_tok` = k of them (a router per module: the k
largest fp32 logits, a softmax over those k, rounded to the model dtype).

Mixture of attention heads (`self_attention`): slot j's query is expert e_j's projection of x, Hkv heads of
`kv_channels` (D); K and V one shared projection (`kv_proj`, K rows first) of Hkv heads. transformers tiles K / V
(q head j * Hkv + g reads KV head g), which is plain GQA once the q heads are ordered (g, j): the engine's attention
runs on [T, Hkv * k, D] and the output goes back to slot order. Then out = sum_j w_j (W_o[e_j] o_j) + bias.
The experts' q projections run for all E experts in one GEMM and the chosen k are gathered; the o projection as one
batched GEMM over the experts of the slots' weighted outputs scattered to their experts (zeros elsewhere): E / k
times the chosen experts' FLOPs, no host sync, CUDA-graph safe. The same sums as transformers' grouped ones, other
roundings (fp32: within the tests' bound).

The MLP: GPT-OSS's / Granite MoE's top-logits block (`input_linear` [E, 2I, H], gate rows first; `output_linear`
[E, H, I]) plus a bias after the sum. Tensor parallelism splits every expert's q rows and o columns by heads and the
MLP experts by width; routers and biases whole on every rank (the bias added once, after the ranks' sum)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ..attention import Attention
from .decoder import DecoderLayer, DecoderSpec
from .layers import Linear, RMSNorm, RotaryEmbedding
from .moe import TopLogitsMoeBlock, route_top_logits
from .parallel import ColumnParallelLinear, all_reduce, divide, get_tp_state, mark_sharded
from .qwen3_moe import Qwen3MoeForCausalLM

_LAYER_NORM_EPS = 1e-6  # transformers builds the layers' two norms without the config's eps


class JetMoeRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.layer = Linear(hidden, num_experts)  # `router.layer.weight`


class JetMoeAttention(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the o projection through the row-invariant matmul

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden, tp = hf_config.hidden_size, get_tp_state()
        self.k, experts = int(hf_config.num_experts_per_tok), int(hf_config.num_local_experts)
        kv_heads, self.head_dim = int(hf_config.num_key_value_heads), int(hf_config.kv_channels)
        self.num_kv_heads = divide(kv_heads, tp.size, "num_key_value_heads")
        self.width = self.num_kv_heads * self.head_dim  # this rank's q rows of one expert (= its K / V width)
        self.experts = nn.Module()  # transformers' `self_attention.experts.*`
        self.experts.router = JetMoeRouter(hidden, experts)
        self.experts.input_linear = ColumnParallelLinear(hidden, [kv_heads * self.head_dim] * experts)
        self.experts.output_linear = nn.Module()  # weight [E * H, Hkv * D]: expert e's rows [e H, (e + 1) H)
        self.experts.output_linear.weight = nn.Parameter(torch.empty(experts * hidden, self.width), requires_grad=False)
        mark_sharded(self.experts.output_linear.weight, 1, tp, kv_heads * self.head_dim)
        self.experts.bias = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.kv_proj = ColumnParallelLinear(hidden, [kv_heads * self.head_dim] * 2)  # K rows | V rows
        self.rotary, self.tp_size, self.num_experts = rotary, tp.size, experts
        self.attn = Attention(layer_idx, self.num_kv_heads * self.k, self.num_kv_heads, self.head_dim,
                              self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        t, k, hkv, d = x.shape[0], self.k, self.num_kv_heads, self.head_dim
        weights, ids = route_top_logits(self.experts.router.layer(x).float(), k)
        weights = weights.to(x.dtype)  # transformers' gates, in the model dtype
        q = self.experts.input_linear(x).view(t, self.num_experts, self.width)
        q = q.gather(1, ids[..., None].expand(t, k, self.width))  # [T, k, Hkv * D]: slot j's expert's query
        q = q.view(t, k, hkv, d).transpose(1, 2).reshape(t, hkv * k * d)  # heads (g, j): GQA groups of k
        key, value = self.kv_proj(x).split([self.width, self.width], dim=-1)
        o = self.attn(positions, q, key, value, self.rotary).view(t, hkv, k, d).transpose(1, 2)  # [T, k, Hkv, D]
        scattered = x.new_zeros(self.num_experts, t, self.width)  # each slot's weighted output at its expert
        slots = (o.reshape(t, k, self.width) * weights[..., None]).transpose(0, 1)  # [k, T, Hkv * D]
        scattered.view(-1, self.width).index_add_(
            0, (ids.t() * t + torch.arange(t, device=x.device)).reshape(-1), slots.reshape(-1, self.width))
        w_o = self.experts.output_linear.weight.view(self.num_experts, -1, self.width)  # [E, H, Hkv * D]
        if self.batch_invariant:  # each row reduced in an order independent of the batch, expert by expert
            per_expert = [batch_invariant_linear(scattered[e], w_o[e], None) for e in range(self.num_experts)]
            out = torch.stack(per_expert).sum(dim=0)
        else:
            out = torch.bmm(scattered, w_o.transpose(1, 2)).sum(dim=0)  # [T, H]
        if self.tp_size > 1:
            out = all_reduce(out)
        return out + self.experts.bias, residual


class JetMoeMoeBlock(TopLogitsMoeBlock):
    """Granite MoE's top-logits block (its `router.layer`, `input_linear`, `output_linear`) plus `bias` after the
    sum."""

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        self.bias = nn.Parameter(torch.empty(hf_config.hidden_size), requires_grad=False)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = super().route_tokens(x, forced)
        return weights.to(x.dtype).float(), ids  # rounded to the model dtype, as transformers' gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class JetMoeLayer(DecoderLayer):
    attention_class = JetMoeAttention

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, _LAYER_NORM_EPS)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.self_attention = self._modules.pop("self_attn")  # transformers' name

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.self_attention(positions, x, residual, self.input_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


_MLP_NAMES = {"input_linear.weight": "experts.gate_up_proj", "output_linear.weight": "experts.down_proj",
              "router.layer.weight": "gate.weight", "bias": "bias"}


class JetMoeForCausalLM(Qwen3MoeForCausalLM):
    layer_class = JetMoeLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                           head_dim=int(hf_config.kv_channels))

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.model.norm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))  # the final norm's own eps

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return JetMoeMoeBlock(self.config, layer_idx, facts)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".", 4)  # model, layers, N, mlp, rest
        if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] == "mlp" and parts[4] in _MLP_NAMES:
            return ((f"model.layers.{parts[2]}.mlp.{_MLP_NAMES[parts[4]]}", tensor),)
        if name.endswith("self_attention.experts.output_linear.weight"):
            tensor = tensor.reshape(-1, tensor.shape[-1])  # [E, H, Hkv D] as [E H, Hkv D]
        return super().checkpoint_parts(name, tensor)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        return {}  # no q | k | v or gate | up parts: every tensor whole (the experts' rows by their own layout)
