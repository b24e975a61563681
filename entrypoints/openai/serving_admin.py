"""Sleep mode and weight updates over HTTP: vLLM's POST /sleep, POST /wake_up, GET /is_sleeping and
POST /reset_prefix_cache, and SGLang's POST /update_weights_from_disk (for a trainer that shares the GPU with the
server, or pushes new weights)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from ...engine.protocol import EngineClient
from ..http.errors import APIError, bad_request
from .streaming import engine_error

ADMIN_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/update_weights_from_disk",
               "/reset_prefix_cache")  # behind --api-key
EMPTY_200_PATHS = ("/sleep", "/wake_up", "/reset_prefix_cache")  # 200 with an empty body, as vLLM's
FIELDS = ("level", "tags", "model_path")  # a ValueError starting with one names it as `param`
Level = Annotated[int, Query(json_schema_extra={"enum": [1, 2]},
                             description="1: the weights kept in host memory; 2: discarded")]
Tags = Annotated[list[Literal["weights", "kv_cache"]] | None,
                 Query(description="what to wake (repeat the parameter); none: everything")]


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's body (only the field this engine uses: other SGLang options are refused, never ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str  # a checkpoint folder (or a hub id, resolved as `--model` is) with the served shapes


class UpdateWeightsFromDiskResponse(BaseModel):
    success: bool  # always true: a failure is an error response (4xx/5xx)
    message: str
    num_tensors: int  # tensors loaded


class IsSleepingResponse(BaseModel):
    is_sleeping: bool


async def _admin(call):
    """Await an admin call (EngineAdmin's, on the engine client); its errors as API errors (ValueError -> 400
    with the engine's message)."""
    try:
        return await call
    except Exception as e:
        raise engine_error(e, FIELDS) from e


def admin_router(engine: EngineClient) -> APIRouter:
    router = APIRouter()

    @router.post("/sleep", response_class=Response)
    async def sleep(level: Level = 1):
        if level not in (1, 2):  # checked here too: the engine checks sleep mode first
            raise bad_request(f"level must be 1 (weights kept in host memory) or 2 (weights discarded), got {level}",
                              param="level")
        await _admin(engine.sleep(level))
        return Response(status_code=200)

    @router.post("/wake_up", response_class=Response)
    async def wake_up(tags: Tags = None):
        await _admin(engine.wake_up(list(tags) if tags else None))  # vLLM: no tags = all of them
        return Response(status_code=200)

    @router.get("/is_sleeping", response_model=IsSleepingResponse)
    async def is_sleeping():
        return IsSleepingResponse(is_sleeping=await _admin(engine.is_sleeping()))

    @router.post("/reset_prefix_cache", response_class=Response,
                 responses={409: {"description": "requests in flight hold KV blocks: nothing was dropped"}})
    async def reset_prefix_cache():
        if not await _admin(engine.reset_prefix_cache()):
            # vLLM answers 200 and leaves the cache as it was; here the caller learns it has to retry when idle
            raise APIError(409, "requests in flight hold KV blocks: the prefix cache was not dropped; retry once "
                                "they finish", type="conflict_error")
        return Response(status_code=200)

    @router.post("/update_weights_from_disk", response_model=UpdateWeightsFromDiskResponse)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        n = await _admin(engine.update_weights_from_disk(body.model_path))
        return UpdateWeightsFromDiskResponse(success=True, num_tensors=n,
                                             message=f"Succeeded to update model weights ({n} tensors).")

    return router
