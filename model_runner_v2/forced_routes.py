"""Forced MoE routes (routing replay, SamplingParams.trace_routed_experts; docs/moe.md): each slot's routes on the
host, and one step's [T, num_layers, top_k] tensor assembled from its rows' positions.

Host-side on purpose: a step needs only the rows of its own positions, which the input batch already knows
(num_computed_tokens + the chunk), so chunked prefill, fast replay chunks, speculative verify steps and a
preempted request's recompute all read the same rows. A step without any forced position passes None (the MoE
blocks then route as usual, at no cost)."""

from __future__ import annotations

import numpy as np
import torch


class ForcedRoutes:
    def __init__(self, num_layers: int, top_k: int, device: torch.device):
        self.num_layers, self.top_k, self.device = num_layers, top_k, device
        self.by_slot: dict[int, np.ndarray] = {}  # slot -> int16 [P, num_layers, top_k] (checked at admission)

    def add(self, slot: int, routes: np.ndarray | None) -> None:
        if routes is None:
            self.by_slot.pop(slot, None)
        else:
            self.by_slot[slot] = routes

    def remove(self, slot: int) -> None:
        self.by_slot.pop(slot, None)

    def for_step(self, host_slots: np.ndarray, positions_start: np.ndarray, query_start_loc: np.ndarray
                 ) -> torch.Tensor | None:
        """[T, num_layers, top_k] int16 on the device: the forced ids of each of the step's tokens, -1 where a
        token is not forced (a row without routes, or positions >= its P). None: no token of the step is forced.
        host_slots / positions_start [B] (num_computed_tokens), query_start_loc [B + 1]: the step's rows."""
        if not self.by_slot:
            return None
        out: np.ndarray | None = None
        for i, slot in enumerate(host_slots.tolist()):
            routes = self.by_slot.get(slot)
            if routes is None:
                continue
            start, lo, hi = int(positions_start[i]), int(query_start_loc[i]), int(query_start_loc[i + 1])
            n = min(hi - lo, routes.shape[0] - start)  # the chunk's positions that have forced routes
            if n <= 0:
                continue
            if out is None:
                out = np.full((int(query_start_loc[-1]), self.num_layers, self.top_k), -1, dtype=np.int16)
            out[lo : lo + n] = routes[start : start + n]
        if out is None:
            return None
        host = torch.from_numpy(out)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)
