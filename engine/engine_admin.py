"""EngineAdmin: sleep mode and weight updates as one set of async calls on both engine front-ends."""

from __future__ import annotations

from typing import Any

# LLMEngine methods reachable this way (vLLM's sleep-mode names, SGLang's weight update); the core process
# allows them as utility calls (core_proc.UTILITY_METHODS).
ADMIN_METHODS = ("sleep", "wake_up", "is_sleeping", "update_weights_from_disk", "reset_prefix_cache")


class EngineAdmin:
    """vLLM's `sleep` / `wake_up` / `is_sleeping` and SGLang's `update_weights_from_disk`, run on the engine
    between steps: by the engine thread in-process (AsyncLLMEngine), as a utility call in the engine core process
    (EngineCoreClient), so the HTTP routes do not care which. A caller's mistake (sleep mode off, a bad level
    or tag, requests in flight, a folder without matching weights) is a ValueError in both; the engine gone is
    request_stream.EngineDeadError; anything else is the engine's fault."""

    async def engine_call(self, method: str, *args: Any) -> Any:
        """LLMEngine.<method>(*args) between steps, and its result (each front-end says how)."""
        raise NotImplementedError

    async def sleep(self, level: int = 1) -> None:
        """Give the KV cache's and the weights' memory back (level 1 keeps the weights in host memory, level 2
        drops them); the engine must be idle, and refuses requests until wake_up."""
        await self.engine_call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back: tags among "weights", "kv_cache" (None: both)."""
        await self.engine_call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        """True while any part (weights or KV cache) is asleep."""
        return bool(await self.engine_call("is_sleeping"))

    async def update_weights_from_disk(self, model_path: str) -> int:
        """Load a checkpoint folder's safetensors in place (same shapes; an idle engine); the tensor count."""
        return int(await self.engine_call("update_weights_from_disk", model_path))

    async def reset_prefix_cache(self) -> bool:
        """vLLM's: drop the prefix cache; False (nothing dropped) while requests hold KV blocks."""
        return bool(await self.engine_call("reset_prefix_cache"))
