"""DeepSeek-V2 (`DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2) and DeepSeek-V3
(`DeepseekV3ForCausalLM`: DeepSeek-V3, R1, Moonlight), as transformers computes them:

- attention: multi-head latent attention (models/mla.py);
- the first `first_k_dense_replace` layers dense (SwiGLU of `intermediate_size`), then sparse layers (every
  `moe_layer_freq`-th, as DeepSeek's own code and vLLM read it; transformers ignores the key, and real
  checkpoints set 1): `n_routed_experts` SwiGLU experts of `moe_intermediate_size` plus the shared experts
  (glm4_moe.SharedExpertsBlock);
- V2's router: fp32 logits, a softmax over all experts, the top k (`topk_method` "greedy"), or the top k inside
  the `topk_group` of `n_group` groups with the highest best score ("group_limited_greedy"); the weights are the
  probabilities times `routed_scaling_factor`, renormalised first when `norm_topk_prob` (DeepSeek's code and
  vLLM; transformers 5 never renormalises V2's, and the released V2 checkpoints all set it false);
- V3's router: GLM-4-MoE's (glm4_moe.route_grouped_sigmoid: sigmoid scores with `e_score_correction_bias`).

Both keep the router in fp32 (`checkpoint_fp32_suffixes`). V3's multi-token-prediction layers
(`model.layers.<num_hidden_layers>.*`) are skipped, as transformers skips them. DeepSeek-V3's released fp8 blocks
are dequantized at load (quantization/fp8_checkpoint.py).

GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) is DeepSeek-V3's model under GLM's config: MLA with a q LoRA, V3's router,
a shared expert, its sparse layers from `mlp_layer_types` (model_config.moe_facts)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from ...kernels.activation import sigmoid, silu
from .decoder import DecoderLayer, DecoderMLP, DecoderSpec
from .glm4_moe import (
    Fp32Router,
    Glm4MoeBlock,
    Glm4MoeForCausalLM,
    SharedExpertsBlock,
    check_groups,
    in_top_groups,
    route_grouped_sigmoid,
    weigh_chosen,
)
from .layers import Linear, RMSNorm, RotaryEmbedding
from .mla import MlaAttention, mla_dims, rope_first
from .parallel import ColumnParallelLinear

TOPK_METHODS = ("greedy", "group_limited_greedy")


def route_softmax_groups(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
                         scale: float, forced: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64), transformers' DeepseekV2TopkRouter op for op
    (n_group 1: "greedy"; a group's score is its best probability). forced [T, k] int16 (routing replay): rows with
    ids >= 0 take them, weighted by their own probabilities alike."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    choice = probs
    if n_group > 1:  # a group's score: its best probability
        num_experts = probs.shape[-1]
        group_scores = probs.view(-1, n_group, num_experts // n_group).max(dim=-1).values  # [T, groups]
        choice = probs.masked_fill(~in_top_groups(group_scores, topk_group, num_experts), 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    return weigh_chosen(probs, ids, forced, renormalize, scale)


class DeepseekV2MoeBlock(SharedExpertsBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        self.gate = Fp32Router(facts["num_experts"], hf_config.hidden_size)
        method = getattr(hf_config, "topk_method", None) or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(f"topk_method {method!r} is not supported for DeepSeek-V2 (supported: "
                             f"{', '.join(TOPK_METHODS)})")
        self.n_group = self.topk_group = 1
        if method == "group_limited_greedy":
            self.n_group, self.topk_group = int(hf_config.n_group), int(hf_config.topk_group)
            check_groups(facts["num_experts"], self.n_group, self.topk_group)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_softmax_groups(self.gate(x), self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                                    self.scale, forced)


class MlaDecoderLayer(DecoderLayer):
    attention_class = MlaAttention


class DeepseekV2ForCausalLM(Glm4MoeForCausalLM):
    layer_class = MlaDecoderLayer
    checkpoint_fp32_suffixes = (".mlp.gate.weight",)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        """Dense MLPs without biases; the rotary over qk_rope_head_dim of each (qk_nope + qk_rope) q/k head, V2's
        complex rotation in fp32 (fp32 cos/sin too) with one rounding."""
        nope, rope, _ = mla_dims(hf_config)
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, rope_interleaved=True,
                           rope_fp32=True, rope_fp32_tables=True, head_dim=nope + rope, rotary_dim=rope)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return DeepseekV2MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The q projection's rows with each head's rope part first (mla.rope_first); the MTP layers skipped
        (Glm4MoeForCausalLM's)."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            nope, rope, _ = mla_dims(self.config)
            tensor = rope_first(tensor, self.config.num_attention_heads, nope, rope)
        return super().checkpoint_parts(name, tensor)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    checkpoint_fp32_suffixes = Glm4MoeForCausalLM.checkpoint_fp32_suffixes

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        """V2's, with the rotation in the model dtype op by op, in interleaved pairs unless `rope_interleave` is
        false (rotate-half pairs)."""
        nope, rope, _ = mla_dims(hf_config)
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                           rope_interleaved=bool(getattr(hf_config, "rope_interleave", True)), head_dim=nope + rope,
                           rotary_dim=rope)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Glm4MoeBlock(self.config, layer_idx, facts, self.spec(self.config))


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash: transformers' Glm4MoeLite is DeepseekV3's attention, router, experts and MTP layer."""


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 (its q LoRA always there) with DeepSeek Sparse Attention — an indexer per layer
    scores the cached keys and each query attends to its `index_topk` best. Served up to max_model_len = index_topk
    (model_config.dense_attention_limit), where the indexer keeps every key: the model is V3 exactly, bit for bit in
    transformers too; the indexer's weights (`self_attn.indexer.*`) are not loaded."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.indexer." in name:
            return ()
        return super().checkpoint_parts(name, tensor)


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5 (Z.ai's GLM-5 / 5.1): DeepSeek-V3.2's model under GLM's config (one expert group, v heads as wide as
    nope + rope); its "shared" indexer layers reuse another layer's choice, all of them every key up to index_topk."""


class AXK1MoeBlock(Glm4MoeBlock):
    """DeepSeek-V3's sparse block with an RMSNorm (`post_mlp_layernorm`) over routed + shared; the router's correction
    bias zeros unless a checkpoint gives one (the released ones route without it)."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        self.post_mlp_layernorm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))
        with torch.no_grad():
            self.gate.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.post_mlp_layernorm(super().forward(x))


class AXK1ForCausalLM(DeepseekV3ForCausalLM):
    """SK Telecom's A.X-K1: DeepSeek-V3 (MLA with a q LoRA, V3's router and shared experts) whose sparse layers norm
    their output (AXK1MoeBlock). Its checkpoints hold `post_mlp_layernorm` at the layer level for every layer (the
    dense layers' unused, skipped as transformers skips them) and no correction bias."""

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return AXK1MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if parts[-2:] == ["post_mlp_layernorm", "weight"] and parts[:2] == ["model", "layers"]:
            if not isinstance(self.model.layers[int(parts[2])].mlp, AXK1MoeBlock):
                return ()  # a dense layer's unused norm
            name = f"model.layers.{parts[2]}.mlp.post_mlp_layernorm.weight"
        return super().checkpoint_parts(name, tensor)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)
        for name in [n for n in pieces if n.endswith(".e_score_correction_bias")]:
            del pieces[name]  # optional: zeros without one
        return pieces


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    """Tencent's Youtu-LLM: DeepSeek-V3's attention (MLA with a q LoRA, the interleaved rotary in the model dtype)
    over Llama's dense SwiGLU MLP in every layer; no router, experts or MTP layer (moe_facts: none)."""

    checkpoint_fp32_suffixes = ()


class GatedRMSNorm(nn.Module):
    """A.X-K2's gated norm (transformers' AXK2GatedRMSNorm): y = RMSNorm(x), then y * sigmoid(fc2(silu(fc1(y)))) with
    the sigmoid and the product in fp32, rounded once; fc1 [rank, H], fc2 [H, rank] (`gated_norm_rank`), replicated
    under tensor parallelism. The RMSNorm methods the layers call on their norms (forward, add_and_norm)."""

    batch_invariant = False  # set_batch_invariant: silu and sigmoid in their row-invariant forms

    def __init__(self, hf_config):
        super().__init__()
        hidden, rank = hf_config.hidden_size, int(hf_config.gated_norm_rank)
        self.norm = RMSNorm(hidden, float(hf_config.rms_norm_eps))
        self.mlp = nn.ModuleDict({"fc1": Linear(hidden, rank), "fc2": Linear(rank, hidden)})

    def gate(self, y: torch.Tensor) -> torch.Tensor:  # the normed y [T, H] -> gated [T, H]
        g = self.mlp["fc2"](silu(self.mlp["fc1"](y), self.batch_invariant)).float()
        return (y.float() * sigmoid(g, self.batch_invariant)).to(y.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.norm(x))

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, residual = self.norm.add_and_norm(x, residual)
        return self.gate(y), residual


class AXK2Attention(MlaAttention):
    """A.X-K2's MLA: no q_b_proj; `q_gate_proj` over [q_a_layernorm(q_a) | q_a] ([2 * q_lora_rank], q_a = q_a_proj(x))
    gives each head its query (rope | nope after the load's permutation) and an output gate of v_head_dim:
    o_proj(out * sigmoid(gate)), in fp32 and rounded once. Tensor parallelism: each head's q | gate rows on its rank."""

    batch_invariant = False  # set_batch_invariant: the gate's sigmoid in its row-invariant form

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        del self.q_b_proj
        rows = hf_config.num_attention_heads * (self.head_dim + self.v_head_dim)
        self.q_gate_proj = ColumnParallelLinear(2 * int(hf_config.q_lora_rank), [rows])

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        q_a = self.q_a_proj(x)  # [T, q_lora_rank]
        q_gate = self.q_gate_proj(torch.cat([self.q_a_layernorm(q_a), q_a], dim=-1))  # [T, H * (D + v)]
        q, gate = q_gate.view(x.shape[0], self.num_heads, -1).split([self.head_dim, self.v_head_dim], dim=-1)
        out = self.attend(positions, x, q.reshape(x.shape[0], -1))  # [T, H * v]
        gated = out.float() * sigmoid(gate.reshape(out.shape).float(), self.batch_invariant)
        return self.o_proj(gated.to(out.dtype)), residual


class AXK2Layer(MlaDecoderLayer):
    attention_class = AXK2Attention

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__(hf_config, spec, layer_idx, rotary, mlp)
        self.input_layernorm = GatedRMSNorm(hf_config)
        if not isinstance(mlp, DecoderMLP):  # a sparse layer's second norm gated too; a dense layer's plain
            self.post_attention_layernorm = GatedRMSNorm(hf_config)


class AXK2MoeBlock(Glm4MoeBlock):
    """DeepSeek-V3's sparse block; without `n_group` (A.X-K2-Light) a plain top k of the corrected sigmoid scores; with
    it the experts outside the chosen groups score 0.0 (transformers' and A.X's reference), not -inf."""

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_grouped_sigmoid(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, self.scale, forced,
                                     self.gate.batch_invariant, fill=0.0)


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    """SK Telecom's A.X-K2: DeepSeek-V3.2 (served up to index_topk, its indexer not loaded) with gated norms
    (GatedRMSNorm: every layer's input norm, a sparse layer's second one), a gated query projection (AXK2Attention)
    and AXK2MoeBlock's router; the rotary always in interleaved pairs. Its checkpoints name `q_gate_proj` `q_b_proj`
    and a gated norm's fc1 / fc2 `W_down` / `W_up` (transformers' renames), experts per expert."""

    layer_class = AXK2Layer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return replace(super().spec(hf_config), rope_interleaved=True)  # transformers' AXK2 reads no rope_interleave

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return AXK2MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The hub's names as transformers' (and the engine's); q_gate_proj's rows [H, nope | rope | gate] with each
        head's rope rows first (mla.rope_first's layout, its gate rows after)."""
        for hub, ours in ((".self_attn.q_b_proj.", ".self_attn.q_gate_proj."), (".W_down.", ".mlp.fc1."),
                          (".W_up.", ".mlp.fc2.")):
            name = name.replace(hub, ours)
        if name.endswith(".self_attn.q_gate_proj.weight"):
            nope, rope, _ = mla_dims(self.config)
            heads = tensor.reshape(self.config.num_attention_heads, -1, *tensor.shape[1:])  # [H, D + v, ...]
            tensor = torch.cat([heads[:, nope : nope + rope], heads[:, :nope], heads[:, nope + rope :]],
                               dim=1).reshape(tensor.shape)
        return super().checkpoint_parts(name, tensor)
