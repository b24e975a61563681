"""SamplingStates: per-slot sampling parameters on the device, with host mirrors for step skipping."""

from __future__ import annotations

import numpy as np
import torch

from ..sampling_params import SamplingParams
from .staged_writes import DirectUpload, StagedSlotWrites, Upload

_F32_MAX = float(np.finfo(np.float32).max)
_I32_MAX = int(np.iinfo(np.int32).max)


class _PaddedSlotRows:
    """Variable-length per-slot rows in one padded `[max_num_reqs, W]` device tensor; how many entries of a row
    are live is kept elsewhere (a count per slot), and entries past it are stale. Writes are staged on the host
    and applied with one `index_put_` per step. W grows (doubling) when a request needs a longer row, so memory
    is only spent when some request asks for it."""

    def __init__(self, max_num_reqs: int, dtype: torch.dtype, device: torch.device, width: int = 16):
        self.tensor = torch.zeros((max_num_reqs, width), dtype=dtype, device=device)
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self._pending: dict[int, np.ndarray] = {}

    def stage(self, slot: int, values) -> None:
        row = np.asarray(values, dtype=self._np_dtype).reshape(-1)
        if row.size > self.tensor.shape[1]:
            self._grow(row.size)
        self._pending[slot] = row

    def _grow(self, need: int) -> None:
        old = self.tensor
        width = old.shape[1]
        while width < need:
            width *= 2
        self.tensor = torch.zeros((old.shape[0], width), dtype=old.dtype, device=old.device)
        self.tensor[:, : old.shape[1]] = old

    def apply(self, upload: Upload | None = None) -> None:
        if not self._pending:
            return
        width = max(row.size for row in self._pending.values())
        vals = np.zeros((len(self._pending), width), dtype=self._np_dtype)
        for i, row in enumerate(self._pending.values()):  # one short row per new request, not per token
            vals[i, : row.size] = row
        slots = np.fromiter(self._pending, dtype=np.int64, count=len(self._pending))
        self._pending.clear()

        def write(slots: torch.Tensor, vals: torch.Tensor) -> None:
            self.tensor[slots, :width] = vals  # the tensor as it is then (a later stage may have grown it)

        (upload or DirectUpload(self.tensor.device)).add([slots, vals], write)


class LogitBiasState:
    """Per-slot `logit_bias` and `allowed_token_ids`: token ids (and biases) as padded device rows, plus a count
    per slot (0 = unused) with a host mirror that lets the sampler skip each step when no row uses it.

    `add_request` always stages both counts, so a slot reused by another request never keeps its previous
    owner's bias or mask: the sampler ops ignore every entry past a row's count."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        def count() -> StagedSlotWrites:
            return StagedSlotWrites(torch.zeros(max_num_reqs, dtype=torch.int32, device=device))

        self.num_bias = count()
        self.bias_token_ids = _PaddedSlotRows(max_num_reqs, torch.int32, device)  # [N, W] distinct ids per row
        self.bias_values = _PaddedSlotRows(max_num_reqs, torch.float32, device)  # [N, W] added to those logits
        self.num_allowed = count()
        self.allowed_token_ids = _PaddedSlotRows(max_num_reqs, torch.int32, device)  # [N, W'] the only ids kept

    def add_request(self, slot: int, params: SamplingParams) -> None:
        bias = params.logit_bias or {}
        self.num_bias.stage(slot, len(bias))
        if bias:
            self.bias_token_ids.stage(slot, list(bias.keys()))
            self.bias_values.stage(slot, list(bias.values()))
        allowed = np.unique(params.allowed_token_ids) if params.allowed_token_ids else ()  # duplicates: no-ops
        self.num_allowed.stage(slot, len(allowed))
        if len(allowed):
            self.allowed_token_ids.stage(slot, allowed)

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        for t in (self.num_bias, self.bias_token_ids, self.bias_values, self.num_allowed, self.allowed_token_ids):
            t.apply(upload)


class SamplingStates:
    """One entry per runner slot. Device tensors feed the sampler's vectorised steps; the host mirrors answer
    "does any row of this batch need step X?" without a device read."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        def slot_tensor(dtype: torch.dtype, fill: float) -> StagedSlotWrites:
            return StagedSlotWrites(torch.full((max_num_reqs,), fill, dtype=dtype, device=device))

        self.temperature = slot_tensor(torch.float32, 1.0)  # 0 = greedy
        self.top_k = slot_tensor(torch.int32, 0)  # 0 = off
        self.top_p = slot_tensor(torch.float32, 1.0)
        self.min_p = slot_tensor(torch.float32, 0.0)
        self.presence_penalty = slot_tensor(torch.float32, 0.0)
        self.frequency_penalty = slot_tensor(torch.float32, 0.0)
        self.repetition_penalty = slot_tensor(torch.float32, 1.0)
        self.seed = slot_tensor(torch.int64, 0)
        self._all = [self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                     self.frequency_penalty, self.repetition_penalty, self.seed]
        # Host-only rules (applied from host-built index lists).
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs requested
        self.full_logprobs = np.zeros(max_num_reqs, dtype=bool)  # return_full_logprobs: copy whole rows
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # masked while under min_tokens
        # Bad words by prefix: {prefix length n: {the n tokens before the last: [last tokens]}} per slot, so a
        # step costs one lookup per distinct word length, not one comparison per word (10k words: 20k ids lists).
        self.bad_words: list[dict[int, dict[tuple[int, ...], list[int]]]] = [{} for _ in range(max_num_reqs)]
        self.has_bad_words = np.zeros(max_num_reqs, dtype=bool)
        self.logit_bias = LogitBiasState(max_num_reqs, device)  # logit_bias + allowed_token_ids

    def add_request(self, slot: int, params: SamplingParams, seed: int, eos_token_ids: tuple[int, ...],
                    bad_words_token_ids: list[list[int]]) -> None:
        # Finite values past the slots' dtypes (temperature 1e300, top_k 2**40: all valid) saturate at the dtype's
        # largest value, which the sampler treats the same (a flat distribution; no truncation past the vocab).
        self.temperature.stage(slot, 0.0 if params.is_greedy else min(params.temperature, _F32_MAX))
        self.top_k.stage(slot, min(params.top_k, _I32_MAX))
        self.top_p.stage(slot, params.top_p)
        self.min_p.stage(slot, params.min_p)
        self.presence_penalty.stage(slot, params.presence_penalty)
        self.frequency_penalty.stage(slot, params.frequency_penalty)
        self.repetition_penalty.stage(slot, min(params.repetition_penalty, _F32_MAX))
        self.seed.stage(slot, seed)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.full_logprobs[slot] = params.return_full_logprobs
        self.min_tokens[slot] = params.min_tokens
        eos = [] if params.ignore_eos else list(eos_token_ids)
        self.stop_ids[slot] = eos + list(params.stop_token_ids) if params.min_tokens else []
        self.bad_words[slot] = _by_prefix(bad_words_token_ids)
        self.has_bad_words[slot] = bool(bad_words_token_ids)
        self.logit_bias.add_request(slot, params)

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        for t in self._all:
            t.apply(upload)
        self.logit_bias.apply_staged_writes(upload)


def _by_prefix(words: list[list[int]]) -> dict[int, dict[tuple[int, ...], list[int]]]:
    """[[a, b, c], [d]] -> {2: {(a, b): [c]}, 0: {(): [d]}}: a word is banned when the output ends in its prefix."""
    index: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for word in words:
        index.setdefault(len(word) - 1, {}).setdefault(tuple(word[:-1]), []).append(word[-1])
    return index
