"""EngineClient: what the HTTP server calls on an engine, met by AsyncLLMEngine and EngineCoreClient alike.

Structural (typing.Protocol): neither class inherits it. AsyncLLMEngine runs the engine on a thread of the
server's process (build_app(engine=...), tests); EngineCoreClient talks to the engine core process (`replayllm
serve`). tests/engine/test_engine_client_protocol.py checks that both have every member with a compatible signature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..config import EngineConfig, ModelConfig
from ..sampling_params import SamplingParams
from .engine_stats import EngineSnapshot, StatsSink
from .request_stream import RequestStream
from .tokenizer_pool import TokenizerPool

T = TypeVar("T")


@runtime_checkable
class PromptProcessor(Protocol):
    """What `EngineClient.run_tokenizer` hands its callback: the engine's tokenizer side, read-only (the
    InputProcessor; in-process, the LLMEngine that holds it). The serving layer reads these and no more."""

    tokenizer: Any  # a transformers tokenizer; None with --skip-tokenizer-init
    model_config: ModelConfig
    config: EngineConfig  # the engine's options (max_logprobs, max_model_len, ...)

    def tokenize(self, prompt: str, add_special_tokens: bool = True, max_model_len: int | None = None
                 ) -> list[int]: ...

    def decode_token(self, token: int) -> str | None: ...

    def process_prompt(self, prompt, add_special_tokens: bool = True, truncate: int | None = None
                       ) -> tuple[str | None, list[int]]: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the serving classes (serving_*.py) and build_app use it: lifecycle, tokenization off the
    event loop, queueing requests as one stream, and the admin calls of engine_admin.EngineAdmin. Errors are the
    same on both: ValueError for the caller's mistakes (before anything is queued), request_stream's
    EngineDeadError / EngineAsleepError when the engine cannot take work, tokenizer_pool's ServerBusyError."""

    stats: StatsSink  # where request and step counters go (build_app sets the server's ServerMetrics)
    snapshot: EngineSnapshot  # the engine's gauges (KV blocks, queue lengths), refreshed after each step
    tokenizer_pool: TokenizerPool  # the threads run_tokenizer uses; also parses large bodies (body_offload.py)

    @property
    def is_running(self) -> bool:
        """False before start() and once the engine stopped or died (/health answers 503)."""
        ...

    def start(self) -> None:
        """Start serving (from the app's lifespan, on its event loop)."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; requests still in flight fail with EngineDeadError."""
        ...

    async def run_tokenizer(self, fn: Callable[[PromptProcessor], T], *, size: int) -> T:
        """fn(prompt processor) on the tokenizer pool; `size` (the input's characters) picks its lane."""
        ...

    async def add_requests(self, request_id: str, prompts: list, params: list[SamplingParams]) -> RequestStream:
        """Check every prompt and params, then queue them together (all or nothing) as `{request_id}-{i}`."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (RequestStream.abort calls it when a client goes away)."""
        ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def is_sleeping(self) -> bool: ...

    async def update_weights_from_disk(self, model_path: str) -> int: ...

    async def reset_prefix_cache(self) -> bool: ...
