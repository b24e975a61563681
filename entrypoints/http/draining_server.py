"""DrainingServer: uvicorn's shutdown with a deadline: requests in flight get GRACE_S, then fail with an error."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("replayllm.server")
GRACE_S = 3.0  # after SIGTERM / Ctrl-C, requests in flight may still finish within this
WRITE_S = 2.0  # then they are failed; this is their time to write the error JSON / SSE error event


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown (SIGTERM, Ctrl-C, or `should_exit`) stops accepting, lets requests in
    flight finish for GRACE_S, then calls `fail_in_flight(reason)`: every request still running (generating or
    tokenizing) ends with a 503 error JSON, every stream with an SSE error event and `[DONE]`. uvicorn's own
    deadline (`timeout_graceful_shutdown`, GRACE_S + WRITE_S) then cancels what is left, and the app's lifespan
    stops the engine core: the server exits in seconds however busy it is."""

    def __init__(self, config: uvicorn.Config, fail_in_flight: Callable[[str], None],
                 before_shutdown: Callable[[], None] | None = None):
        """before_shutdown: called as the shutdown begins (the first API server process tells the others to
        drain too: `replayllm serve --api-server-count`)."""
        super().__init__(config)
        self._fail_in_flight = fail_in_flight
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self._before_shutdown is not None:
            self._before_shutdown()
        timer = asyncio.get_running_loop().call_later(GRACE_S, self._expire)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _expire(self) -> None:
        logger.warning("shutting down: failing the requests still in flight after %.0f s", GRACE_S)
        self._fail_in_flight("the server is shutting down")
