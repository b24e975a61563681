"""IntakeGate: at most N generation requests between their arrival and their hand-off to the engine, the others
waiting at the gate in arrival order. On by default with 8 places (`REPLAYLLM_INTAKE_GATE=N` sets N, 0 turns it
off): on the H200 host it paid at a burst of text prompts (docs/benchmarks.md, session 28)."""

from __future__ import annotations

import asyncio
import contextvars
import os

from .auth_middleware import route_path

ENV = "REPLAYLLM_INTAKE_GATE"  # places past the gate; 0: no gate; unset: DEFAULT_PLACES
# Twice the tokenizer pool's default workers (4): the pool stays busy while later arrivals wait at the gate.
DEFAULT_PLACES = 8
# The routes whose requests are handed to the engine (the ones a burst of arrivals is made of).
GATED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate"))

# The current task's place: a one-item list shared with the tasks its context is copied into (one the endpoint
# starts), so the place is given back exactly once, by whichever comes first.
_HELD: contextvars.ContextVar[list | None] = contextvars.ContextVar("replayllm_intake_place", default=None)


class IntakeGate:
    """Why: at a burst of arrivals the event loop runs each request's intake up to its first wait, in arrival
    order. A request that waits for the tokenizer pool (a text prompt to encode, a chat template to render)
    resumes only after every request that arrived behind it has run up to its own wait: at rate=inf with 500
    text prompts every hand-off to the engine came after all 500 intakes (head -> response start 450-497 ms on
    average on the CPU machine; token-id prompts, which never wait, 0.6 ms). With at most `permits` requests
    past the gate, later ones queue at it before any other work on them (middlewares, JSON, checks) and the
    pool's answers are taken as they come: hand-offs in arrival order, the pool still busy. An asyncio model
    with free cores moved a 500-request burst's median hand-off 351 -> 239-260 ms; on the 2-core CPU machine it
    cost ~10% more API CPU and moved nothing (session 27); on the H200 host, S1 sent as text (500 x 512/128 at
    once), two alternated pairs: 210.5 / 200.1 -> 226.4 / 224.2 req/s, median TTFT 639 / 728 -> 480 / 495 ms
    (session 28): hence on by default. Token-id prompts never wait inside their intake, so a place is free
    whenever one arrives and the gate costs them a semaphore acquire.

    ReplayFastAPI (openai/sse_response.py) calls `enter()` for the requests `gated` picks; `leave_intake()`
    gives the current task's place back (ServingBase.queue, once the request is in the engine's queue, and the
    app when the call ends)."""

    def __init__(self, permits: int, max_body: int):
        """max_body: bodies at least this large are not gated (the tokenizer pool's large lane takes them, and
        a few of them must not hold every place for seconds)."""
        if permits < 1:
            raise ValueError(f"an intake gate needs at least one place, got {permits}")
        self.permits, self.max_body = permits, max_body
        self._places = asyncio.Semaphore(permits)
        self.inside = 0  # requests past the gate, not yet handed off

    async def enter(self) -> None:
        await self._places.acquire()
        self.inside += 1
        _HELD.set([self])

    def _leave(self) -> None:
        self.inside -= 1
        self._places.release()


def gate_from_env(max_body: int) -> IntakeGate | None:
    """The gate REPLAYLLM_INTAKE_GATE asks for (unset or empty: DEFAULT_PLACES; None: 0; ValueError: not a
    count)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return IntakeGate(DEFAULT_PLACES, max_body)
    if not value.isdigit():
        raise ValueError(f"{ENV} must be a number of places (0: no gate), got {value!r}")
    return IntakeGate(int(value), max_body) if int(value) > 0 else None


def gated(scope, send, max_body: int) -> bool:
    """Whether a request goes through the gate: a POST to a GATED_PATHS route with a Content-Length under
    `max_body` whose body has arrived whole (uvicorn's cycle behind `send` says no more is coming: a client that
    uploads slowly never holds a place). Anything else goes straight on."""
    if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in GATED_PATHS:
        return False
    if getattr(getattr(send, "__self__", None), "more_body", False):
        return False
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) < max_body
    return False


def leave_intake() -> None:
    """Give the current task's place at the gate back (a no-op without one, or once it was given back)."""
    held = _HELD.get()
    if held:
        held.pop()._leave()
