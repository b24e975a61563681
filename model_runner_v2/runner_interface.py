"""RunnerInterface: what the engine needs from a model runner, one rank (ModelRunner) or many (TensorParallelRunner)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch
from torch import nn

from ..step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from .async_output import AsyncModelRunnerOutput


class RunnerInterface(ABC):
    """The engine talks to its runner only through these; both runners implement all of them, so the engine
    never probes for optional methods."""

    num_blocks: int  # KV blocks the engine's BlockManager may hand out (the runner's sink block excluded)
    model: nn.Module  # the model this process runs (with tensor parallelism: rank 0's shard); for inspection

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Step, first half: free and fill slots, prepare the inputs, launch the forward and the logits of the
        sampling rows (and prompt logprobs); the runner keeps them for `sample_tokens`. Returns at once on
        CUDA: the host is free (e.g. to fill grammar bits) while the device runs the forward."""

    @abstractmethod
    def sample_tokens(self, grammar: GrammarBitmask | None) -> AsyncModelRunnerOutput:
        """Step, second half: sample the logits `execute_model` launched (the grammar bits applied first; trace
        replay, logprobs, the device-side token append); `.get()` on the result waits for it. The next step may
        be launched before that: its input ids are read on the device, where this one wrote its tokens."""

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results (the synchronous composition; bits from `sched.grammar`)."""
        self.execute_model(sched)
        return self.sample_tokens(sched.grammar).get()

    @abstractmethod
    def free_requests(self, request_ids: list[str]) -> None:
        """Release the slots of finished or preempted requests (when a step has no rows to carry them)."""

    @abstractmethod
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model in place (weight_update.py: all checked, then all copied; a
        ValueError names a tensor that does not fit and changes nothing). Returns how many were applied."""

    def read_routed_experts(self, block_ids: list[int], num_positions: int) -> np.ndarray:
        """A finished request's MoE routes through its block table: int16 [num_positions, num_layers, top_k]
        (routed_experts.py; only with enable_return_routed_experts)."""
        raise ValueError(f"{type(self).__name__} does not capture routed experts")

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Give the KV cache's and the weights' device memory back (sleep_mode.py): level 1 keeps the weights in
        pinned host memory, level 2 discards them. ValueError when the engine was built without sleep mode."""

    @abstractmethod
    def wake_up(self, tags: list[str]) -> None:
        """Take the memory of `tags` (sleep_mode.TAGS) back at the same addresses; weights kept at level 1 come
        back too, a KV cache comes back zero-filled."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the runner holds: worker processes, device memory (graphs, KV cache, weights);
        idempotent. No step runs afterwards."""
