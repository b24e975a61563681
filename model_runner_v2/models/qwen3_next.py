"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text): hybrid decoders whose `layer_types` mix Gated DeltaNet layers
("linear_attention": gated_deltanet.py, a recurrent state per request) with gated full attention (three in four
layers linear in the released configs), as transformers computes them.

The full-attention layer: q_proj gives each head's query and its output gate side by side ([q_h | gate_h] per
head); (1 + weight) q/k RMSNorms, a partial rotary (a quarter of each head, rotate-half pairs), attention over the
paged KV cache, the output times sigmoid(gate), o_proj. Its Attention's layer_idx counts the full-attention layers
only: the linear layers have no KV cache (ModelConfig.num_kv_layers). Every norm of the decoder is (1 + weight) in
fp32. The MLP: Qwen3.5's dense SwiGLU; Qwen3-Next's sparse layers (mlp_only_layers, decoder_sparse_step) and
Qwen3.5-MoE's every layer: Qwen2-MoE's routed experts plus a sigmoid-gated shared expert (qwen2_moe.py).

Qwen3.5's rotary is multimodal in transformers (M-RoPE): for text, whose three position components are equal, the
ordinary rotary over the same frequencies (qwen_vl.py says why). The hub's Qwen3.5 checkpoints are the multimodal
ones (`Qwen3_5ForConditionalGeneration`): served as their language model, the vision tower's tensors skipped
(language_model.py); `mtp.*` (the multi-token-prediction head) is skipped too."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...hybrid_facts import layer_types
from ...kernels.activation import sigmoid
from ..attention import Attention
from .decoder import DecoderMLP, DecoderSpec, norm_eps
from .gated_deltanet import GatedDeltaNet
from .language_model import language_model_parts
from .layers import RMSNorm, RotaryEmbedding
from .parallel import ColumnParallelLinear, RowParallelLinear, divide, get_tp_state
from .qwen2_moe import Qwen2MoeForCausalLM


class GatedAttention(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, kv_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden, eps, tp = hf_config.hidden_size, norm_eps(hf_config), get_tp_state().size
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads = divide(heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(kv_heads, tp, "num_key_value_heads")
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(getattr(hf_config, "attention_bias", False))
        # [q_h | gate_h] per head, then k, then v (each part split between the ranks: whole heads)
        q_all, kv_all = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, [2 * q_all, kv_all, kv_all], bias=bias)
        self.o_proj = RowParallelLinear(q_all, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, eps, unit_offset=True)
        self.rotary = rotary
        self.attn = Attention(kv_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.reshape(-1, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim].reshape(-1, self.q_size), qg[..., self.head_dim:].reshape(-1, self.q_size)
        out = self.attn(positions, q, k, v, self.rotary, self.q_norm, self.k_norm)  # [T, Hq * D]
        return self.o_proj(out * sigmoid(gate, self.batch_invariant))


class Qwen3NextLayer(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        kinds = layer_types(hf_config)
        if kinds[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(hf_config)
        else:  # its KV cache: the full-attention layers' count before it
            self.self_attn = GatedAttention(hf_config, kinds[:layer_idx].count("full_attention"), rotary)
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), unit_offset=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.linear_attn(x) if hasattr(self, "linear_attn") else self.self_attn(positions, x)
        if isinstance(self.mlp, DecoderMLP):
            return self.mlp(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


class Qwen3NextForCausalLM(Qwen2MoeForCausalLM):
    layer_class = Qwen3NextLayer
    _GROUPED = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next's per-key-head groups of the linear layers' projection

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for part, value in language_model_parts(name, tensor):
            if part.startswith("mtp."):
                continue  # the multi-token-prediction head: not served
            if part.endswith(".weight") and part.split(".")[-2] in self._GROUPED:
                yield from self._regrouped(part, value)
            elif part.endswith(".in_proj_qkv.weight"):  # q | k | v: three parts, each split under TP
                yield from self._qkv(part.rsplit(".", 2)[0], value.split(self._qkv_sizes(), dim=0))
            else:
                yield part, value

    def _qkv_sizes(self) -> list[int]:
        """All ranks' q, k, v rows of the linear layers' projection."""
        c = self.config
        kd = int(c.linear_num_key_heads) * int(c.linear_key_head_dim)
        return [kd, kd, int(c.linear_num_value_heads) * int(c.linear_value_head_dim)]

    @staticmethod
    def _qkv(prefix: str, parts) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in zip(("in_proj_q", "in_proj_k", "in_proj_v"), parts):
            yield f"{prefix}.{name}.weight", tensor

    def _regrouped(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """`in_proj_qkvz` [Hk * (2 Dk + 2 r Dv), H] (per key head g: q_g, k_g, then the r value heads' v, then
        their z) as Qwen3.5's q, k, v (each head-major) and in_proj_z; `in_proj_ba` [Hk * 2r, H] (per key head: its
        value heads' b, then their a) as in_proj_b and in_proj_a. All ranks' rows (the loader takes each part's
        share)."""
        c = self.config
        hk, hv = int(c.linear_num_key_heads), int(c.linear_num_value_heads)
        s = self.model.layers[int(name.split(".")[2])].linear_attn
        r, prefix = hv // hk, name.rsplit(".", 2)[0]
        groups = tensor.reshape(hk, -1, tensor.shape[-1])  # [Hk, rows per group, H]
        if name.endswith("in_proj_ba.weight"):
            b, a = groups.split([r, r], dim=1)
            yield f"{prefix}.in_proj_b.weight", b.reshape(-1, tensor.shape[-1])
            yield f"{prefix}.in_proj_a.weight", a.reshape(-1, tensor.shape[-1])
            return
        dk, vd = s.key_head_dim, r * s.value_head_dim
        q, k, v, z = (t.reshape(-1, tensor.shape[-1]) for t in groups.split([dk, dk, vd, vd], dim=1))
        yield from self._qkv(prefix, (q, k, v))
        yield f"{prefix}.in_proj_z.weight", z

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        layers = list(self.model.layers)
        attn = next(layer.self_attn for layer in layers if hasattr(layer, "self_attn"))
        q2, kv = 2 * attn.q_size, attn.kv_size
        shards = dict(q_proj=("qkv_proj", 0, q2), k_proj=("qkv_proj", q2, kv), v_proj=("qkv_proj", q2 + kv, kv))
        linear = next((layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")), None)
        if linear is not None:
            shards.update(linear.in_proj_shards())
        dense = [layer.mlp for layer in layers if isinstance(layer.mlp, DecoderMLP)]
        if dense:
            inter = dense[0].intermediate_size
            shards.update(gate_proj=("gate_up_proj", 0, inter), up_proj=("gate_up_proj", inter, inter))
        return shards


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense): every layer's MLP the dense SwiGLU."""

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return DecoderMLP(self.config, self.spec(self.config))


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE: every layer sparse, the top-k always renormalised (moe_facts), stacked experts in the hub's
    checkpoints ([E, 2I, H] / [E, H, I], as transformers holds them) or per expert (what its save_pretrained
    writes): both load."""


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    pass
