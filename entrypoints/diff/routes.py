"""A MoE side's routes in CompletionOutput.routed_experts' layout ([positions, num_layers, top_k] int16, -1 on a
dense layer): read from transformers' router logits or from a trace record."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

ROUTE_DTYPE = np.int16  # as the engine captures them


def hf_routes(router_logits: Sequence, top_k: int, num_layers: int, moe_layers: Sequence[int],
              rows: int) -> np.ndarray:
    """transformers' router logits -> routes [rows, num_layers, top_k].

    router_logits: what `model(ids, output_router_logits=True).router_logits` holds for one sequence: one [T, E]
    tensor per sparse layer, in layer order (Qwen3-MoE records its router's first output per sparse block). Per
    layer the top_k of softmax(logits) in fp32, most probable first: the ids transformers' own router
    (Qwen3MoeTopKRouter: softmax in fp32, then topk) sends each token to. Only the first `rows` positions are
    kept (the engine reports prompt + trace - 1: the last token is never fed)."""
    if len(router_logits) != len(moe_layers):
        raise ValueError(f"transformers returned router logits for {len(router_logits)} layers; the config has "
                         f"{len(moe_layers)} sparse layers {tuple(moe_layers)}")
    out = np.full((rows, num_layers, top_k), -1, dtype=ROUTE_DTYPE)
    for layer, logits in zip(moe_layers, router_logits):
        probs = logits.reshape(-1, logits.shape[-1])[:rows].float().softmax(-1)  # [rows, E]
        out[:, layer] = probs.topk(top_k, dim=-1).indices.cpu().numpy()
    return out


def record_routes(routed_experts: list | None) -> np.ndarray | None:
    """A trace record's stored routes (nested lists, validated by trace_schema) as an int16 array, or None."""
    return None if routed_experts is None else np.asarray(routed_experts, dtype=ROUTE_DTYPE)
