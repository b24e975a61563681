"""AsyncModelRunnerOutput: a launched step's results on their way to the host (async scheduling's handle)."""

from __future__ import annotations

import numpy as np
import torch

from ..sampling.sampler import MultiPositionRows, SamplerOutput
from ..step_io import ModelRunnerOutput, PromptLogprobsChunk
from .request_states import RequestStates


class AsyncModelRunnerOutput:
    """A launched step's results on their way to the host. The small per-row arrays are copied at launch
    (non-blocking, into pinned memory on CUDA); `get()` waits for them, then updates the slots' host token
    mirrors — only of slots still owned by the same request (with async scheduling a request may have
    finished, and its slot been reused, while the step ran)."""

    def __init__(self, req_ids: list[str], prompt_logprobs: dict[str, PromptLogprobsChunk],
                 sampler_output: SamplerOutput | None = None, host_slots: np.ndarray | None = None,
                 req_states: RequestStates | None = None, multi_position: MultiPositionRows | None = None):
        """`sampler_output` None: no row sampled this step (the output is complete already). req_ids [R] of the sampled
        rows; host_slots [S], the slot of each sampled position; multi_position: fast-replay rows (None: S == R)."""
        self._req_ids, self._prompt_logprobs = req_ids, prompt_logprobs
        self._sampler_output, self._host_slots = sampler_output, host_slots
        self._req_states, self._multi_position = req_states, multi_position
        self._out: ModelRunnerOutput | None = None
        self._event = None
        if sampler_output is None:
            self._out = ModelRunnerOutput(req_ids, np.zeros(0, dtype=np.int64), prompt_logprobs=prompt_logprobs)
            return
        self._sampled = _copy_to_host_async(sampler_output.sampled)
        self._logprob = _copy_to_host_async(sampler_output.logprob)
        self._rank = _copy_to_host_async(sampler_output.rank)
        self._topk_ids = _copy_to_host_async(sampler_output.topk_ids)
        self._topk_logprobs = _copy_to_host_async(sampler_output.topk_logprobs)
        self._accepted = _copy_to_host_async(sampler_output.accepted)  # speculative steps: [S] bool, the kept positions
        if sampler_output.sampled.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @classmethod
    def completed(cls, out: ModelRunnerOutput) -> AsyncModelRunnerOutput:
        """An output whose step has already finished (a runner that executes synchronously)."""
        handle = cls(out.req_ids, out.prompt_logprobs)
        handle._out = out
        return handle

    def get(self) -> ModelRunnerOutput:
        if self._out is not None:
            return self._out  # idempotent: a second get() returns the same output
        sampler_output = self._sampler_output
        if self._event is not None:
            self._event.synchronize()  # the step's one wait for the device
        multi_position = self._multi_position
        # Row of each sampled position: [S] (the identity without fast-replay rows).
        pos_row = (None if multi_position is None
                   else np.repeat(np.arange(len(self._req_ids)), multi_position.num_sampled))
        full_logprobs: dict[str, np.ndarray] = {}
        if sampler_output.full_logprobs is not None:
            full = sampler_output.full_logprobs.cpu().numpy()  # [F, V]
            full_rows = sampler_output.full_rows
            rows = full_rows if pos_row is None else pos_row[full_rows]  # [F], a row's positions adjacent
            cuts = np.flatnonzero(np.diff(rows)) + 1
            full_logprobs = {self._req_ids[rows[a]]: full[a:b]  # [n, V] per request
                             for a, b in zip(np.r_[0, cuts], np.r_[cuts, rows.size])}
        out = ModelRunnerOutput(
            req_ids=self._req_ids,
            sampled=self._sampled.numpy(),
            logprob=_numpy(self._logprob),
            rank=_numpy(self._rank),
            topk_ids=_numpy(self._topk_ids),
            topk_logprobs=_numpy(self._topk_logprobs),
            full_logprobs=full_logprobs,
            prompt_logprobs=self._prompt_logprobs,
            num_sampled=None if multi_position is None else multi_position.num_sampled,
        )
        req_states = self._req_states
        row_slots = self._host_slots if multi_position is None else self._host_slots[multi_position.host_last]  # [R]
        slot_of = req_states.req_id_to_slot
        owned = np.array([slot_of.get(rid) == s for rid, s in zip(out.req_ids, row_slots.tolist())],
                         dtype=bool)  # Python ints compare faster than numpy scalars
        host_slots = self._host_slots
        if multi_position is None:
            req_states.append_sampled_host(host_slots[owned], out.sampled[owned])
        else:
            owned, offsets = owned[pos_row], multi_position.host_step_offsets  # [S]
            if self._accepted is not None:  # speculative: drop rejected positions from every [S] array
                kept = self._accepted.numpy()
                _keep_positions(out, kept, pos_row)
                owned, offsets, host_slots = owned[kept], offsets[kept], host_slots[kept]
            req_states.append_sampled_host(host_slots[owned], out.sampled[owned], offsets[owned])
        self._out, self._sampler_output = out, None
        return out


def _keep_positions(out: ModelRunnerOutput, kept: np.ndarray, pos_row: np.ndarray) -> None:
    """Cut a speculative step's output to its kept positions: kept [S] bool, pos_row [S] the row of each."""
    for name in ("sampled", "logprob", "rank", "topk_ids", "topk_logprobs"):
        value = getattr(out, name)
        if value is not None:
            setattr(out, name, value[kept])
    out.num_sampled = np.bincount(pos_row[kept], minlength=len(out.req_ids)).astype(np.int64)


def _copy_to_host_async(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or not t.is_cuda:
        return None if t is None else t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.numpy()
