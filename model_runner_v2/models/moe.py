"""The sparse MoE MLP block (Qwen3-MoE's, Mixtral's): router -> fp32 softmax -> top-k -> experts' SwiGLU, weighted sum.

Expert compute: on CUDA the fused Triton experts (kernels/fused_moe.py: grouped GEMMs over expert-sorted token
copies, no host sync, static shapes, so CUDA graphs hold the whole layer); elsewhere (CPU) plain torch, the token
copies grouped by expert and each expert that got any running its two matmuls on its group (a host sync for the
group sizes). Both give every (token, choice) copy its own output row and sum a token's k rows in choice order,
so a token's result does not depend on its batch. The expert weights are stacked per layer, flat, which both
read as they are."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import (
    ClampedSiLU,
    ClampedSwiGLU,
    clamp_gate_up,
    clamped_swiglu_invariant_torch,
    clamped_swiglu_torch,
    gelu_tanh_and_mul_invariant_torch,
    gelu_tanh_and_mul_torch,
)
from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ...kernels.fused_moe import combine_copies, fused_experts_triton
from ..forward_context import get_forward_context
from .layers import Linear, SiluAndMul
from .parallel import all_reduce, divide, get_tp_state, mark_sharded


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (model dtype) -> (weights [T, k] fp32, expert ids [T, k] int64): softmax over all
    experts in fp32, the k most probable (descending), renormalised to sum 1 when norm_topk_prob (as HF)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_forced(router_logits: torch.Tensor, forced: torch.Tensor, top_k: int, norm_topk_prob: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """route() where forced [T, k] int16 (one layer's rows of ForwardContext.forced_experts) says so: a row with
    ids >= 0 uses them instead of the top-k, weighted by the router's own fp32 probabilities of them (renormalised
    when norm_topk_prob), as routing replay ("R3") does; a row of -1 routes as route() would, to the same bits
    (the gathered probabilities are the top-k values, summed alike)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    own = probs.topk(top_k, dim=-1).indices
    ids = torch.where(forced[:, :1] >= 0, forced.long(), own)  # admission checked: a row is all forced or not
    weights = probs.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_top_logits(router_logits: torch.Tensor, top_k: int, forced: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router: the k largest logits (in the model dtype, descending, as transformers' topk) and a softmax
    over those k alone in fp32 -> (weights [T, k] fp32, ids [T, k] int64). forced [T, k] int16 as route_forced:
    rows with ids >= 0 take them, weighted by the softmax over their own logits."""
    ids = router_logits.topk(top_k, dim=-1).indices
    if forced is not None:
        ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
    return torch.softmax(router_logits.gather(-1, ids).float(), dim=-1), ids


class StackedExperts(nn.Module):
    """E SwiGLU experts. gate_up_proj [E * 2I, H]: expert e's gate rows then its up rows, rows [e*2I, (e+1)*2I);
    down_proj [E * H, I]. Flat 2-D parameters so HF's per-expert tensors load as row ranges (DecoderLM.weight_target)
    and transformers 5's stacked [E, 2I, H] / [E, H, I] tensors as their flattening; `.view(E, ...)` is free.

    Tensor parallelism (vLLM's TP MoE): every rank holds every expert with I / tp of its width — each expert's gate
    and up rows split like a column-parallel layer (2E parts of I rows), down_proj's columns like a row-parallel
    one — so `intermediate_size` is this rank's I and a rank's output is a partial sum (SparseMoeBlock reduces).

    relu2: ungated ReLU² experts (NemotronH's): `up_proj` [E * I, H] (expert e's rows [e*I, (e+1)*I)) in place of
    gate_up_proj, down(relu(up(x))²). gelu_tanh: GeGLU experts (gelu_tanh(gate) * up: Gemma 4's)."""

    batch_invariant = False  # set_batch_invariant: the row-invariant matmul (each row's sum in a fixed order)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 clamped: ClampedSwiGLU | ClampedSiLU | None = None, relu2: bool = False, gelu_tanh: bool = False,
                 fp32_weights: bool = False):
        """bias: gate_up_proj_bias [E * 2I] (each expert's gate | up, split as its rows) and down_proj_bias
        [E * H] (whole on every rank, added by rank 0 only: the ranks' outputs are summed); clamped: GPT-OSS's
        activation instead of SiLU(gate) * up, or ClampedSiLU (HY-V4's clamped inputs); fp32_weights: the copies
        weighed and summed in fp32 (kernels/fused_moe.combine_copies: a router whose transformers form hands fp32
        weights to its experts)."""
        super().__init__()
        self.fp32_weights = fp32_weights
        state = get_tp_state()
        local = divide(intermediate_size, state.size, "moe_intermediate_size")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, local
        if relu2 + gelu_tanh + (clamped is not None) > 1 or (relu2 and bias):
            raise ValueError("experts take one activation (SiLU's by default, clamped, relu2 or gelu_tanh); relu2 ones "
                             "no bias")
        self.relu2, self.gelu_tanh = relu2, gelu_tanh
        parts = 1 if relu2 else 2  # up, or gate | up
        w13 = nn.Parameter(torch.empty(num_experts * parts * local, hidden_size), requires_grad=False)
        mark_sharded(w13, 0, state, num_experts * parts * intermediate_size,
                     [intermediate_size] * (parts * num_experts))
        if relu2:
            self.up_proj = w13
        else:
            self.gate_up_proj = w13
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, local), requires_grad=False)
        mark_sharded(self.down_proj, 1, state, intermediate_size)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts * 2 * local), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts * hidden_size), requires_grad=False)
            mark_sharded(self.gate_up_proj_bias, 0, state, num_experts * 2 * intermediate_size,
                         [intermediate_size] * (2 * num_experts))
        self.adds_down_bias = bias and state.rank == 0
        self.clamped = clamped
        self.act = SiluAndMul()

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.relu2:
            return torch.square(F.relu(gate_up))  # transformers' two ops (relu exact, the square rounded once)
        if self.gelu_tanh:  # GeGLU (Gemma 4's experts)
            return (gelu_tanh_and_mul_invariant_torch if self.batch_invariant else gelu_tanh_and_mul_torch)(gate_up)
        if self.clamped is None:
            return self.act(gate_up)
        if isinstance(self.clamped, ClampedSiLU):  # HY-V4's: SwiGLU on the clamped gate | up
            return self.act(clamp_gate_up(gate_up, self.clamped.limit))
        if self.batch_invariant:
            return clamped_swiglu_invariant_torch(gate_up, self.clamped)
        return clamped_swiglu_torch(gate_up, self.clamped)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(x, weight, None) if self.batch_invariant else F.linear(x, weight)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] int64, weights [T, k] fp32 -> sum_j weights[:, j] * expert_{ids[:, j]}(x) [T, H].
        Each (token, j) copy's expert output lands in its own row, then the k rows of a token are summed in j order:
        a row's result does not depend on which other tokens share the step."""
        num_tokens, k = ids.shape
        w13 = (self.up_proj if self.relu2 else self.gate_up_proj).view(self.num_experts, -1, self.hidden_size)
        w2 = self.down_proj.view(self.num_experts, self.hidden_size, self.intermediate_size)
        b13 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias.view(self.num_experts, -1)
        b2 = self.down_proj_bias.view(self.num_experts, -1) if self.adds_down_bias else None
        if x.is_cuda:  # one tile per dtype, never chosen from T: batch invariant in either mode
            return fused_experts_triton(x, w13, w2, ids, weights, b13=b13, b2=b2, act=self.clamped, relu2=self.relu2,
                                        gelu_tanh=self.gelu_tanh, fp32_weights=self.fp32_weights)
        flat = ids.reshape(-1)  # [T*k], copy c = token c // k, choice c % k
        order = torch.argsort(flat, stable=True)  # copies grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # host sync: the groups' sizes
        out = x.new_empty(num_tokens * k, self.hidden_size)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            copies = order[start : start + n]
            start += n
            gate_up = self._linear(x[copies // k], w13[e])  # [n, 2I]
            if b13 is not None:  # transformers adds the biases to the rounded products (fused_experts_torch)
                gate_up = gate_up + b13[e]
            h = self._activate(gate_up)  # [n, I]
            y = self._linear(h, w2[e])  # [n, H]
            out[copies] = y if b2 is None else y + b2[e]
        return combine_copies(out.view(num_tokens, k, self.hidden_size), weights, self.fp32_weights)


class SparseMoeBlock(nn.Module):
    """One sparse layer's MLP: `gate` (the router, HF mlp.gate.weight [E, H]) and `experts`. Records its routes in
    the forward context's routed-experts buffer when the engine keeps one (enable_return_routed_experts), and uses
    the forward context's forced experts where a request replays routes (trace_routed_experts)."""

    # a router whose transformers form hands its experts fp32 weights (DeepSeek-V3's, GLM-4-MoE's, sigmoid scores with
    # a correction): the copies weighed and summed in fp32, rounded once (StackedExperts' fp32_weights); the others'
    # (softmax routers cast to the model dtype: Mixtral's, Qwen's) weigh each copy in the model dtype
    fp32_weights = False

    def __init__(self, hf_config, layer_idx: int, facts: dict, router_bias: bool = False, expert_bias: bool = False,
                 clamped: ClampedSwiGLU | None = None):
        """facts: model_config.moe_facts of the architecture (experts, top-k, each expert's width, renormalised).
        GPT-OSS's block: router_bias (its router's), expert_bias and clamped (StackedExperts). A router of another
        rule (GPT-OSS's, GLM-4-MoE's) overrides `route_tokens`."""
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.layer_idx = layer_idx
        self.top_k = facts["num_experts_per_tok"]
        self.norm_topk_prob = facts["norm_topk_prob"]
        num_experts, hidden = facts["num_experts"], hf_config.hidden_size
        self.gate = Linear(hidden, num_experts, bias=router_bias)
        self.experts = StackedExperts(num_experts, hidden, facts["moe_intermediate_size"], expert_bias, clamped,
                                      fp32_weights=self.fp32_weights)
        self.tp_size = get_tp_state().size  # > 1: each rank's experts give a partial sum over their I / tp columns

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int64); forced [T, k] int16: this layer's routes
        replayed where a row's ids are >= 0 (routing replay), None: none."""
        if forced is None:
            return route(self.gate(x), self.top_k, self.norm_topk_prob)
        return route_forced(self.gate(x), forced, self.top_k, self.norm_topk_prob)

    def record_routes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route_tokens' (weights, ids) [T, k] each, with the forward context's forced routes (routing replay) and
        the routes recorded where the engine keeps them."""
        ctx = get_forward_context()
        forced = None if ctx.forced_experts is None else ctx.forced_experts[:, self.layer_idx]
        weights, ids = self.route_tokens(x, forced)  # [T, k] each
        if ctx.routed_experts is not None:
            ctx.routed_experts[ctx.attn_metadata.slot_mapping, self.layer_idx] = ids.to(torch.int16)
        return weights, ids

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The ranks' partial sums added (tensor parallelism); out itself on one rank."""
        return all_reduce(out) if self.tp_size > 1 else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.record_routes(x)
        return self.reduce(self.experts(x, ids, weights))  # [T, H]


class TopLogitsMoeBlock(SparseMoeBlock):
    """A sparse block whose router softmaxes its k largest logits (route_top_logits): GPT-OSS's, Granite MoE's."""

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_top_logits(self.gate(x), self.top_k, forced)
