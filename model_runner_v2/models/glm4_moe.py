"""GLM-4-MoE (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6), as transformers' Glm4Moe computes it:

- attention: Llama's with a q/k/v bias (`attention_bias`, none on o_proj), Qwen3's per-head q/k RMSNorms when
  `use_qk_norm`, half of each head rotating (`partial_rotary_factor` 0.5, rotate-half pairs);
- the first `first_k_dense_replace` layers dense (SwiGLU of `intermediate_size`), the others sparse:
  - the router (`mlp.gate`) in fp32: logits = x(fp32) W(fp32)^T, scores = sigmoid(logits); the experts are chosen
    on scores + `e_score_correction_bias` (DeepSeek-V3's aux-loss-free balancing), first the `topk_group` best of
    `n_group` groups (a group's score: the sum of its two best), then the top k inside them; each chosen expert's
    weight is its score without the bias, renormalised (`norm_topk_prob`) and times `routed_scaling_factor`
    (route_grouped_sigmoid);
  - `n_routed_experts` SwiGLU experts of `moe_intermediate_size` (moe.StackedExperts), plus a shared expert every
    token runs, ungated, of width moe_intermediate_size * n_shared_experts (`mlp.shared_experts.*`).

Checkpoints keep the router's weight and its correction bias in fp32 (transformers' keep-in-fp32 list); the loader
reads them without rounding them to the model dtype (`checkpoint_fp32_suffixes`). The multi-token-prediction layer
(`model.layers.<num_hidden_layers>.*`, for speculative decoding) is skipped, as transformers skips it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import sigmoid
from ...kernels.batch_invariant_matmul import batch_invariant_linear
from .decoder import DecoderMLP, DecoderSpec
from .moe import SparseMoeBlock
from .qwen2_moe import Qwen2MoeForCausalLM


def in_top_groups(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """group_scores [T, n_group] -> [T, E] bool: each expert whether its group is among the row's topk_group best
    (transformers' scatter of the chosen groups into a mask, expanded over each group's experts)."""
    n_group = group_scores.shape[-1]
    groups = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()  # [T, groups]
    return kept[:, :, None].expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)


def weigh_chosen(values: torch.Tensor, ids: torch.Tensor, forced: torch.Tensor | None, renormalize: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen experts (forced ones where a row has them: routing replay) weighted by their own values [T, E],
    renormalised to sum 1 when asked (transformers' + 1e-20 in the denominator), times `scale`."""
    if forced is not None:
        ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
    weights = values.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def route_grouped_sigmoid(logits: torch.Tensor, correction: torch.Tensor, top_k: int, n_group: int,
                          topk_group: int, renormalize: bool, scale: float, forced: torch.Tensor | None = None,
                          invariant: bool = False, fill: float = float("-inf")) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int64), transformers' Glm4MoeTopkRouter op for op.
    forced [T, k] int16 (routing replay): rows with ids >= 0 take them, weighted by their own scores alike;
    invariant: batch-invariant mode's sigmoid (kernels/activation.py: torch's differs between a CPU vector's body
    and its tail); fill: the choice score of the experts outside the chosen groups (A.X-K2's 0.0: one of them may
    then beat a chosen group's expert whose score + correction is negative)."""
    scores = sigmoid(logits, invariant)
    choice = scores + correction
    num_experts = choice.shape[-1]
    group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
    kept = in_top_groups(group_scores, topk_group, num_experts)
    ids = torch.topk(choice.masked_fill(~kept, fill), k=top_k, dim=-1, sorted=False)[1]
    return weigh_chosen(scores, ids, forced, renormalize, scale)


class Fp32Router(nn.Module):
    """`mlp.gate`: weight [E, H] in fp32 whatever the model dtype; x [T, H] -> fp32 logits x(fp32) W^T [T, E]
    (DeepSeek-V2's router). `batch_invariant` (layers.set_batch_invariant): through the row-invariant matmul."""

    batch_invariant = False

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E] fp32 logits
        if self.batch_invariant:
            return batch_invariant_linear(x.float(), self.weight, None)
        return F.linear(x.float(), self.weight)


class GroupedSigmoidRouter(Fp32Router):
    """Fp32Router with e_score_correction_bias [E] (fp32) beside its weight: GLM-4-MoE's and DeepSeek-V3's."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__(num_experts, hidden_size)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)


def check_groups(num_experts: int, n_group: int, topk_group: int) -> None:
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{num_experts} experts in n_group={n_group} groups, topk_group={topk_group}: the groups "
                         "must split the experts evenly and 1 <= topk_group <= n_group")


class SharedExpertsBlock(SparseMoeBlock):
    """A sparse block plus `mlp.shared_experts`: a dense SwiGLU of width moe_intermediate_size * n_shared_experts that
    every token runs, ungated, added to the routed sum (GLM-4-MoE, DeepSeek-V2 / V3). `scale`:
    `routed_scaling_factor`, which the routers fold into their weights."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.scale = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        width = int(hf_config.moe_intermediate_size) * int(getattr(hf_config, "n_shared_experts", 0) or 0)
        self.shared_experts = DecoderMLP(hf_config, spec, intermediate_size=width) if width else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        routed = super().forward(x)
        if self.shared_experts is None:
            return routed
        return routed + self.shared_experts.down(self.shared_experts.gate_up_proj(x))


class Glm4MoeBlock(SharedExpertsBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        self.gate = GroupedSigmoidRouter(facts["num_experts"], hf_config.hidden_size)
        # one group where the config names none (HY-V3's plain top-k over the corrected scores)
        self.n_group = int(getattr(hf_config, "n_group", 1) or 1)
        self.topk_group = int(getattr(hf_config, "topk_group", 1) or 1)
        check_groups(facts["num_experts"], self.n_group, self.topk_group)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_grouped_sigmoid(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, self.scale, forced,
                                     self.gate.batch_invariant)


class Glm4MoeForCausalLM(Qwen2MoeForCausalLM):
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", False)), o_bias=False, mlp_bias=False,
                           qk_norm=bool(getattr(hf_config, "use_qk_norm", False)), partial_rotary_factor=0.5)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return Glm4MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        mtp = parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit()
        if mtp and int(parts[2]) >= self.config.num_hidden_layers:
            return ()  # the multi-token-prediction layer
        if getattr(self.config, "model_type", None) in _BAILING_NAMED:
            parent = super().checkpoint_parts
            return [part for renamed in _bailing_parts(self.config, name, tensor) for part in parent(*renamed)]
        return super().checkpoint_parts(name, tensor)


# Sarvam-30B's and Param2's checkpoints (transformers runs them as GLM-4-MoE: full-head rope and q/k norms from their
# configs) keep Bailing-MoE's names: word_embeddings, attention.{query_key_value (rows [q | k | v]), dense,
# query_layernorm, key_layernorm}, gate.expert_bias
_BAILING_NAMED = ("sarvam_moe", "param2moe")
_PROJ = ("q_proj", "k_proj", "v_proj")
_BAILING_RENAMES = ((".attention.", ".self_attn."),
                    (".self_attn.dense.", ".self_attn.o_proj."), (".self_attn.query_layernorm.", ".self_attn.q_norm."),
                    (".self_attn.key_layernorm.", ".self_attn.k_norm."),
                    (".mlp.gate.expert_bias", ".mlp.gate.e_score_correction_bias"))


def _bailing_parts(config, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    if name.startswith("model.word_embeddings."):
        name = "model.embed_tokens." + name[len("model.word_embeddings."):]
    for old, new in _BAILING_RENAMES:
        name = name.replace(old, new)
    if ".self_attn.query_key_value." not in name:
        return ((name, tensor),)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    pieces = tensor.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
    return tuple((name.replace("query_key_value", proj), piece) for proj, piece in zip(_PROJ, pieces))
