"""Routed-experts capture (enable_return_routed_experts, docs/moe.md): which experts every MoE layer chose at
every position, kept the way the KV cache keeps K/V.

One device buffer [num_kv_slots, num_layers, top_k] int16, indexed by KV slot (block * block_size + offset).
Every forward writes its tokens' top-k ids at the step's slot_mapping (moe.SparseMoeBlock), so the buffer always
holds the routes of what the KV cache holds: a prefix-cache hit finds the routes its blocks were computed with,
chunked prefill and fast replay write as they go, a preempted request's recompute writes them again. A request's
routes are read back through its block table when it finishes, before its blocks can be handed to anyone else.
Dense layers of a mixed model are never written: their rows stay -1."""

from __future__ import annotations

import numpy as np
import torch


class RoutedExperts:
    def __init__(self, num_slots: int, num_layers: int, top_k: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.buffer = torch.full((num_slots, num_layers, top_k), -1, dtype=torch.int16, device=device)

    def read(self, block_ids: list[int], num_positions: int) -> np.ndarray:
        """Positions 0 .. num_positions - 1 of the request whose block table is `block_ids`:
        int16 [num_positions, num_layers, top_k] (a host copy; waits for the steps that write them)."""
        pos = np.arange(num_positions, dtype=np.int64)
        table = np.asarray(block_ids, dtype=np.int64)
        slots = torch.from_numpy(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        return self.buffer[slots.to(self.buffer.device)].cpu().numpy()
