"""CoreOutputReader on a real ZeroMQ socket: the event loop watches the socket's edge-triggered descriptor
(loop.add_reader), so every way a drain can stop must leave it re-armed or schedule the rest."""

from __future__ import annotations

import asyncio
import time

import pytest

from replayllm.engine.core_messages import ENCODER, CoreOutputs
from replayllm.engine.core_output_reader import MAX_COALESCED_STEPS, CoreOutputReader


def _loops():
    loops = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:  # uvloop is a Linux dependency: its absence is a platform fact, not a skip
        return loops
    return loops + [pytest.param(uvloop.new_event_loop, id="uvloop")]


class _Wire:
    """A bound reader and a PUSH socket into it; `routed` lists each route call's step numbers."""

    def __init__(self, tmp_path, fail_on: int | None = None):
        import zmq

        self.ctx, self.routed, self.errors = zmq.Context(), [], []

        def route(msgs):
            if fail_on is not None and any(m.num_step_reqs == fail_on for m in msgs):
                raise RuntimeError("routing failed")
            self.routed.append([m.num_step_reqs for m in msgs])

        self.reader = CoreOutputReader(route, self.errors.append)
        path = f"ipc://{tmp_path}/out"
        self.reader.bind(self.ctx, path)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(path)

    def send(self, *steps: int) -> None:
        for n in steps:
            self.push.send(ENCODER.encode(CoreOutputs(num_step_reqs=n)))

    def flat(self) -> list[int]:
        return [n for call in self.routed for n in call]

    async def until(self, count: int) -> None:
        deadline = time.monotonic() + 30
        while len(self.flat()) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def close(self) -> None:
        self.push.close(linger=0)
        self.reader.close()
        self.ctx.term()


def _run(new_loop, main):
    loop = new_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


@pytest.mark.parametrize("new_loop", _loops())
def test_a_drain_cut_at_the_cap_routes_the_rest_with_no_new_arrival(tmp_path, new_loop):
    """More steps queued than one pass routes: the first MAX_COALESCED_STEPS go together, the rest on the loop's
    next pass, although no new message makes the descriptor signal again."""
    wire = _Wire(tmp_path)
    total = MAX_COALESCED_STEPS + 6

    async def main():
        wire.send(*range(total))
        assert wire.reader.socket.poll(30_000)  # at least the first is there (before the watch: run must look)
        time.sleep(0.2)  # the rest (ipc: microseconds)
        task = asyncio.create_task(wire.reader.run())
        await wire.until(total)
        task.cancel()

    try:
        _run(new_loop, main)
    finally:
        wire.close()
    assert wire.flat() == list(range(total))
    assert [len(c) for c in wire.routed] == [MAX_COALESCED_STEPS, 6]


@pytest.mark.parametrize("new_loop", _loops())
def test_the_descriptor_signals_again_after_a_hand_off_took_the_frames(tmp_path, new_loop):
    """A request's hand-off (poll) takes frames between two wake-ups of the reader callback; later steps still
    wake it, in order, with no poll."""
    wire = _Wire(tmp_path)

    async def main():
        task = asyncio.create_task(wire.reader.run())
        wire.send(0)
        await wire.until(1)  # the callback alone
        wire.send(1, 2)
        time.sleep(0.2)  # the loop busy with an intake while they arrive
        wire.reader.poll()  # the hand-off routes what is there
        for n in range(3, 40):  # then the callback alone, one at a time
            wire.send(n)
            await wire.until(n + 1)
        task.cancel()

    try:
        _run(new_loop, main)
    finally:
        wire.close()
    assert wire.flat() == list(range(40))


@pytest.mark.parametrize("new_loop", _loops())
def test_a_routing_failure_reports_once_and_ends_the_reader(tmp_path, new_loop):
    wire = _Wire(tmp_path, fail_on=1)

    async def main():
        task = asyncio.create_task(wire.reader.run())
        wire.send(0)
        await wire.until(1)
        wire.send(1)
        await asyncio.wait_for(task, 30)  # run returns: the descriptor is no longer watched
        wire.send(2)
        await asyncio.sleep(0.1)

    try:
        _run(new_loop, main)
    finally:
        wire.close()
    assert wire.flat() == [0] and wire.errors == ["the engine core's output stream failed"]


@pytest.mark.parametrize("new_loop", _loops())
def test_close_while_running_stops_watching_and_poll_is_a_no_op(tmp_path, new_loop):
    """The client's shutdown closes the reader before the cancelled task has run: the descriptor must be out of
    the loop before its socket closes, and a later poll does nothing."""
    wire = _Wire(tmp_path)

    async def main():
        task = asyncio.create_task(wire.reader.run())
        wire.send(0)
        await wire.until(1)
        task.cancel()
        wire.reader.close()
        wire.reader.poll()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        _run(new_loop, main)
    finally:
        wire.close()
    assert wire.flat() == [0] and wire.errors == []
