"""The sparse MoE MLP block (Qwen3-MoE's): router -> fp32 softmax -> top-k -> experts' SwiGLU, weighted sum.

Expert compute is plain torch for now: the token copies are grouped by expert and each expert that got any runs
its two matmuls on its group (a host sync for the group sizes, so no CUDA graph can hold it; EngineConfig turns
graphs off for MoE models). The expert weights are stacked per layer, so a grouped-GEMM kernel can replace the
loop later without touching the loading."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ..forward_context import get_forward_context
from .layers import Linear, SiluAndMul


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


class StackedExperts(nn.Module):
    """E SwiGLU experts. gate_up_proj [E * 2I, H]: expert e's gate rows then its up rows, rows [e*2I, (e+1)*2I);
    down_proj [E * H, I]. Flat 2-D parameters so HF's per-expert tensors load as row ranges (DecoderLM.weight_target)
    and transformers 5's stacked [E, 2I, H] / [E, H, I] tensors as their flattening; `.view(E, ...)` is free."""

    batch_invariant = False  # set_batch_invariant: the row-invariant matmul (each row's sum in a fixed order)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size), requires_grad=False)
        self.act = SiluAndMul()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(x, weight, None) if self.batch_invariant else F.linear(x, weight)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] int64, weights [T, k] fp32 -> sum_j weights[:, j] * expert_{ids[:, j]}(x) [T, H].
        Each (token, j) copy's expert output lands in its own row, then the k rows of a token are summed in j order:
        a row's result does not depend on which other tokens share the step."""
        num_tokens, k = ids.shape
        w13 = self.gate_up_proj.view(self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        w2 = self.down_proj.view(self.num_experts, self.hidden_size, self.intermediate_size)
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
            h = self.act(self._linear(x[copies // k], w13[e]))  # [n, 2I] -> [n, I]
            out[copies] = self._linear(h, w2[e])  # [n, H]
        # HF weighs each expert's output in the model dtype, then sums.
        return (out.view(num_tokens, k, self.hidden_size) * weights.to(x.dtype)[..., None]).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """One sparse layer's MLP: `gate` (the router, HF mlp.gate.weight [E, H]) and `experts`. Records its routes in
    the forward context's routed-experts buffer when the engine keeps one (enable_return_routed_experts), and uses
    the forward context's forced experts where a request replays routes (trace_routed_experts)."""

    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.layer_idx = layer_idx
        self.top_k = int(hf_config.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(hf_config, "norm_topk_prob", False))
        num_experts, hidden = int(hf_config.num_experts), hf_config.hidden_size
        self.gate = Linear(hidden, num_experts)
        self.experts = StackedExperts(num_experts, hidden, int(hf_config.moe_intermediate_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        if ctx.forced_experts is None:
            weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)  # [T, k] each
        else:  # routing replay: some of the step's tokens are forced to given experts
            weights, ids = route_forced(self.gate(x), ctx.forced_experts[:, self.layer_idx], self.top_k,
                                        self.norm_topk_prob)
        if ctx.routed_experts is not None:
            ctx.routed_experts[ctx.attn_metadata.slot_mapping, self.layer_idx] = ids.to(torch.int16)
        return self.experts(x, ids, weights)
