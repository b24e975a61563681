"""The engine core's wire format: one msgspec message per loop turn out, pickled commands in."""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import numpy as np

# Commands (API server -> core), each one pickled tuple (kind, payload, client): SamplingParams is a rich
# dataclass (enums, trace lists) and commands are one per HTTP call, not per token, so pickle's generality costs
# nothing that matters. `client`: the sending API server process's index (--api-server-count; 0 when there is
# one), whose output socket gets the results. The outputs (per step, per token) are msgspec.
ADD = "add"  # [(parent_id, PreparedRequest)]: queued together (one HTTP call's prompts)
ABORT = "abort"  # [parent_id]: unknown or finished ids are ignored
UTILITY = "utility"  # (call_id, method name, args): an engine method from core_proc.UTILITY_METHODS
SHUTDOWN = "shutdown"  # None: leave the loop, shut the engine down, exit 0


def encode_command(kind: str, payload: Any, client: int = 0) -> bytes:
    return pickle.dumps((kind, payload, client), protocol=pickle.HIGHEST_PROTOCOL)


def decode_command(frame: bytes) -> tuple[str, Any, int]:
    return pickle.loads(frame)


class PromptLogprobsPart(msgspec.Struct, array_like=True, gc=False):
    """step_io.PromptLogprobsChunk as lists: logprobs of prompt tokens start+1 .. start+J of one request."""

    request_id: str  # the child id (completion 0 fills a request's prompt logprobs)
    start: int
    token_ids: list[int]  # [J]
    logprob: list[float]  # [J]
    rank: list[int]  # [J]
    topk_ids: list[list[int]]  # [J, K]
    topk_logprobs: list[list[float]]  # [J, K]


class RoutedExpertsPart(msgspec.Struct, array_like=True, gc=False):
    """A finished sequence's CompletionOutput.routed_experts (enable_return_routed_experts): int16 bytes + shape."""

    request_id: str  # the child id
    shape: tuple[int, int, int]  # [seq_len - 1, num_layers, top_k]
    data: bytes  # C-order int16

    @classmethod
    def of(cls, request_id: str, routes: np.ndarray) -> RoutedExpertsPart:
        return cls(request_id, tuple(routes.shape), np.ascontiguousarray(routes, dtype=np.int16).tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.int16).reshape(self.shape).copy()  # writable, as in process


class CoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine-core loop turn produced: flat per-row arrays (row r = the r-th request that got a token),
    no per-token objects and no text (the API server process detokenizes)."""

    # Row r = one generated token; a fast-replay request that got n tokens this step has n consecutive rows.
    req_ids: list[str] = []  # [R] child (sequence) ids that got a token this step
    token_ids: list[int] = []  # [R]
    num_cached_tokens: list[int] = []  # [R] prompt tokens served from the prefix cache (-1: not scheduled yet)
    # The step's sampled-token logprobs, when any row asked: [R] each, top-k [R, K] (K: the largest asked).
    logprob: list[float] = []
    rank: list[int] = []
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    full_logprobs: dict[str, bytes] = {}  # child id -> [n, V] float32 raw log-softmax (return_full_logprobs)
    prompt_logprobs: list[PromptLogprobsPart] = []
    finished: list[tuple[str, str, int | str | None]] = []  # (child id, finish reason, stop reason) this step
    routed_experts: list[RoutedExpertsPart] = []  # of the sequences in `finished` (enable_return_routed_experts)
    scheduled: dict[str, float] = {}  # parent id -> monotonic start of the step that first scheduled it
    step_started: float = 0.0  # time.monotonic() (one clock for both processes on one host)
    step_ended: float = 0.0
    num_step_reqs: int = 0  # rows of the step (0: no step this turn)
    num_step_tokens: int = 0  # tokens it generated
    step_error: str | None = None  # the step raised: every request in flight was failed (`failed`)
    failed: list[str] = []  # parent ids
    # (parent id, message): requests the engine failed for their own input (a grammar that did not compile);
    # the API server ends each with a ValueError of that message (a 400), the others keep going
    rejected: list[tuple[str, str]] = []
    # parent ids not added because the engine sleeps (another API server process put it to sleep: each one's
    # own check cannot see that); the API server answers EngineAsleepError (a 503)
    asleep: list[str] = []
    snapshot: tuple[int, ...] = ()  # EngineSnapshot's fields in order, after the turn
    utility: list[tuple[int, bool, Any]] = []  # (call id, ok, result or error text)


class CoreReady(msgspec.Struct, array_like=True):
    """The handshake (core -> API server through a pipe): the engine is built (error None) or failed to build."""

    error: str | None = None
    snapshot: tuple[int, ...] = ()  # EngineSnapshot's fields of the fresh engine


ENCODER = msgspec.msgpack.Encoder()
OUTPUTS_DECODER = msgspec.msgpack.Decoder(CoreOutputs)


def decode_ready(frame: bytes) -> CoreReady:
    return msgspec.msgpack.decode(frame, type=CoreReady)
