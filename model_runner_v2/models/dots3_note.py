"""Dots 3 Note's text model (`Dots3NoteForCausalLM`, dots.studio), as transformers 5.25's Dots3Note computes it:
DeepSeek-V3.2's model (MLA with a q LoRA, DeepSeek-V3's sigmoid router with its correction, shared experts, the
layers `mlp_layer_types` calls dense a SwiGLU of `intermediate_size`) with its own attention:

- the normed q latent times sqrt(hidden / q_lora_rank) before q_b_proj, the normed KV latent times
  sqrt(hidden / kv_lora_rank) before kv_b_proj, both latent norms at the config's `rms_norm_eps` (DeepSeek's: 1e-6);
- the shared rotary key RMS-normed (`k_rope_only_layernorm`) before its rotation;
- each head's output times sigmoid(g_proj(x)) [T, H] (the normed input; the model dtype) before o_proj;
- two kinds of layer (dots3_facts): "indexed_attention" (DeepSeek Sparse Attention, served up to max_model_len =
  `index_topk`, where its indexer keeps every key: dense MLA; the indexer's weights are not loaded) or
  "full_attention" (use_dsa false), and "sliding_attention" (a window of `sliding_window` keys) with its own heads,
  latent ranks and head widths (`per_layer_config`) and rope theta. Each kind rotates its own qk_rope_head_dim in
  interleaved pairs: the indexed layers' cos / sin and rotation in fp32, rounded once (transformers computes their
  tables from fp32 embeddings), the others' in the model dtype op by op (DeepSeek-V3's).

The two kinds' KV caches differ in shape (ModelConfig.kv_layer_shapes): piecewise CUDA graphs are refused
(dots3_facts.resolve_dots3_options). The multi-token-prediction layers (`model.layers.<num_hidden_layers>.*`,
`model.mtp.*`) are skipped, as transformers skips them."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn

from ...dots3_facts import Dots3Layer, dots3_layers
from ...kernels.activation import sigmoid
from ...model_config import position_limit
from ...rope_settings import RopeSettings
from .decoder import DecoderMLP, DecoderSpec
from .deepseek import DeepseekV32ForCausalLM, MlaDecoderLayer
from .glm4_moe import Glm4MoeBlock, Glm4MoeForCausalLM
from .layers import RMSNorm, RotaryEmbedding
from .mla import MlaAttention, rope_first
from .parallel import ColumnParallelLinear


def layer_view(hf_config, plan: Dots3Layer) -> SimpleNamespace:
    """What MlaAttention reads of a config, for one layer (its own geometry and rope: the global config's
    per-kind rope_parameters name no single one)."""
    return SimpleNamespace(hidden_size=hf_config.hidden_size, num_attention_heads=plan.heads,
                           qk_nope_head_dim=plan.nope, qk_rope_head_dim=plan.rope, v_head_dim=plan.v_dim,
                           kv_lora_rank=plan.kv_lora_rank, q_lora_rank=plan.q_lora_rank,
                           attention_bias=bool(getattr(hf_config, "attention_bias", False)),
                           rope_parameters={"rope_type": "default", "rope_theta": plan.theta})


class Dots3Attention(MlaAttention):
    """`self_attn` of a Dots 3 Note layer: MLA (models/mla.py) over this layer's geometry, with the scaled latents, the
    normed rotary key and the per-head output gate (`g_proj`: each head's row on its rank under tensor parallelism).
    The indexer is not built (dense within index_topk)."""

    batch_invariant = False  # set_batch_invariant: the gate's sigmoid in its row-invariant form

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        plan = dots3_layers(hf_config)[layer_idx]
        super().__init__(layer_view(hf_config, plan), spec, layer_idx, rotary)
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.q_a_layernorm = RMSNorm(plan.q_lora_rank, eps)
        self.kv_a_layernorm = RMSNorm(plan.kv_lora_rank, eps)
        self.k_rope_only_layernorm = RMSNorm(plan.rope, eps)
        self.q_lora_scale = (hidden / plan.q_lora_rank) ** 0.5
        self.kv_lora_scale = (hidden / plan.kv_lora_rank) ** 0.5
        self.g_proj = ColumnParallelLinear(hidden, [plan.heads])  # [T, hidden] -> this rank's heads' gates

    def query(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, H * (rope + nope)]
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) * self.q_lora_scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        out = self.attend(positions, x, self.query(x))  # [T, H * v]
        gate = sigmoid(self.g_proj(x), self.batch_invariant)  # [T, H], the model dtype as transformers'
        gated = out.view(x.shape[0], self.num_heads, self.v_head_dim) * gate[..., None]
        return self.o_proj(gated.reshape(out.shape)), residual

    def attend(self, positions: torch.Tensor, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """MlaAttention.attend with the KV latent scaled after its norm and the rotary key normed before its
        rotation: the normed input x [T, hidden], queries q [T, H * D] -> each head's output [T, H * v]."""
        num_tokens, heads = x.shape[0], self.num_heads
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent) * self.kv_lora_scale)
        kv = kv.view(num_tokens, heads, self.nope + self.v_head_dim)
        k_rope = self.k_rope_only_layernorm(k_rope)  # [T, rope], one head shared by all
        k = torch.cat([k_rope[:, None, :].expand(num_tokens, heads, self.rope), kv[..., : self.nope]], dim=-1)
        v = nn.functional.pad(kv[..., self.nope :], (0, self.head_dim - self.v_head_dim))  # zeros past v
        out = self.attn(positions, q, k.view(num_tokens, -1), v.view(num_tokens, -1), self.rotary)  # [T, H * D]
        return out.view(num_tokens, heads, self.head_dim)[..., : self.v_head_dim].reshape(num_tokens, -1)


class Dots3DecoderLayer(MlaDecoderLayer):
    """A Dots 3 Note decoder layer; `rotaries` (each kind's, set per model by Dots3NoteForCausalLM) replaces the
    model-wide rotary DecoderModel hands every layer."""

    attention_class = Dots3Attention
    rotaries: dict[str, RotaryEmbedding] = {}

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        kind = dots3_layers(hf_config)[layer_idx].kind
        super().__init__(hf_config, spec, layer_idx, self.rotaries[kind], mlp)


def kind_rotaries(hf_config) -> dict[str, RotaryEmbedding]:
    """One RotaryEmbedding per kind of layer, over its nope + rope heads (rope_first's layout), interleaved pairs."""
    rotaries = {}
    for plan in dots3_layers(hf_config):
        if plan.kind not in rotaries:
            indexed = plan.kind == "indexed_attention"
            settings = RopeSettings(theta=plan.theta)
            rotaries[plan.kind] = RotaryEmbedding(plan.head_dim, position_limit(hf_config), settings,
                                                  interleaved=True, fp32_math=indexed, rotary_dim=plan.rope,
                                                  fp32_tables=indexed)
    return rotaries


class Dots3MoeBlock(Glm4MoeBlock):
    """DeepSeek-V3's sparse block whose shared experts are `shared_experts_intermediate_size` x n_shared_experts
    wide (not moe_intermediate_size's multiple)."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        shared = int(getattr(hf_config, "n_shared_experts", 0) or 0)
        if shared < 1:
            raise ValueError("config.json: Dots 3 Note needs n_shared_experts >= 1 (transformers' Dots3Note does)")
        width = int(hf_config.shared_experts_intermediate_size) * shared
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width)


def _rope_view(hf_config):
    """A shallow copy of the config whose rope_parameters also name "full_attention" (DecoderModel's model-wide
    rotary reads that entry; Dots 3 Note's layers use their kinds' own: kind_rotaries)."""
    view, rope = copy.copy(hf_config), dict(hf_config.rope_parameters)
    view.rope_parameters = {**rope, "full_attention": rope.get("full_attention") or next(iter(rope.values()))}
    return view


class Dots3NoteForCausalLM(DeepseekV32ForCausalLM):
    def __init__(self, hf_config):
        dots3_layers(hf_config)  # a bad layer plan refused before anything is built
        self.layer_class = type("Dots3DecoderLayer", (Dots3DecoderLayer,), {"rotaries": kind_rotaries(hf_config)})
        super().__init__(_rope_view(hf_config))

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Dots3MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The indexer's and the MTP module's tensors skipped; q_b_proj's rows with each head's rope part first
        (mla.rope_first), by its own layer's geometry."""
        if ".self_attn.indexer." in name or name.startswith("model.mtp."):
            return ()
        parts = name.split(".")
        if name.endswith(".self_attn.q_b_proj.weight") and parts[2].isdigit():
            if int(parts[2]) < self.config.num_hidden_layers:
                plan = dots3_layers(self.config)[int(parts[2])]
                tensor = rope_first(tensor, plan.heads, plan.nope, plan.rope)
        return Glm4MoeForCausalLM.checkpoint_parts(self, name, tensor)  # (DeepSeek-V2's permutes by layer 0's)
