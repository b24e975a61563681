"""ClientRoutes (engine/client_routes.py): one engine-core turn's CoreOutputs cut per API server process
(`replayllm serve --api-server-count N`): each gets its own requests' rows, finishes and errors, all get the
turn's shared fields, and the routes of requests that ended are forgotten."""

from __future__ import annotations

from replayllm.engine.client_routes import ClientRoutes
from replayllm.engine.core_messages import CoreOutputs, PromptLogprobsPart, RoutedExpertsPart


def _routes() -> ClientRoutes:
    routes = ClientRoutes(3)
    routes.add("a", ["a"], 0)
    routes.add("b", ["b-0", "b-1"], 1)  # n = 2
    routes.add("c", ["c"], 1)
    routes.add("d", ["d"], 2)
    return routes


def test_rows_and_their_arrays_go_to_their_process_in_order():
    routes = _routes()
    msg = CoreOutputs(req_ids=["b-0", "a", "c", "b-1", "gone"], token_ids=[10, 11, 12, 13, 14],
                      num_cached_tokens=[0, 1, 2, 3, 4], logprob=[-0.5, -1.0, -1.5, -2.0, -2.5],
                      rank=[1, 2, 3, 4, 5], topk_ids=[[1], [2], [3], [4], [5]],
                      topk_logprobs=[[-0.1], [-0.2], [-0.3], [-0.4], [-0.5]],
                      snapshot=(7, 8), step_started=1.0, step_ended=2.0, num_step_reqs=5, num_step_tokens=5)
    zero, one, two = routes.split(msg, [])
    assert (zero.req_ids, zero.token_ids, zero.logprob, zero.rank, zero.topk_ids) == (["a"], [11], [-1.0], [2], [[2]])
    assert one.req_ids == ["b-0", "c", "b-1"] and one.token_ids == [10, 12, 13]
    assert one.num_cached_tokens == [0, 2, 3] and one.topk_logprobs == [[-0.1], [-0.3], [-0.4]]
    assert two.req_ids == [] and two.token_ids == [] and two.logprob == []  # "gone": nobody waits for it
    for part in (zero, one, two):  # the turn's shared fields, to every process (their /metrics gauges)
        assert (part.snapshot, part.step_started, part.step_ended, part.num_step_reqs, part.num_step_tokens) == (
            (7, 8), 1.0, 2.0, 5, 5)
    assert len(routes) == 4  # nothing finished


def test_finishes_errors_logprob_parts_and_utility_results():
    routes = _routes()
    part = PromptLogprobsPart("d", 0, [1], [-0.1], [1], [[1]], [[-0.1]])
    experts = RoutedExpertsPart("a", (1, 1, 1), b"\x00\x00")
    msg = CoreOutputs(finished=[("b-0", "length", None), ("a", "stop", 2)], full_logprobs={"c": b"x", "zz": b"y"},
                      prompt_logprobs=[part], routed_experts=[experts], scheduled={"c": 3.0, "d": 4.0},
                      failed=["d"], step_error="boom", rejected=[("c", "bad grammar")], asleep=[],
                      utility=[(5, True, 1), (5, False, "ValueError: x")])
    zero, one, two = routes.split(msg, [2, 0])  # both processes used call id 5: told apart by the asker
    assert zero.finished == [("a", "stop", 2)] and zero.routed_experts == [experts] and zero.utility == [
        (5, False, "ValueError: x")]
    assert one.finished == [("b-0", "length", None)] and one.full_logprobs == {"c": b"x"}
    assert one.scheduled == {"c": 3.0} and one.rejected == [("c", "bad grammar")] and one.failed == []
    assert two.prompt_logprobs == [part] and two.failed == ["d"] and two.scheduled == {"d": 4.0}
    assert two.utility == [(5, True, 1)]
    assert {zero.step_error, one.step_error, two.step_error} == {"boom"}
    # "a" finished, "c" was rejected, "d" failed: gone. "b" has a sequence still running: kept.
    assert len(routes) == 1 and routes.client_of("b") == 1 and routes.client_of("a") is None
    one = routes.split(CoreOutputs(req_ids=["b-1"], token_ids=[1], finished=[("b-1", "length", None)]), [])[1]
    assert one.req_ids == ["b-1"] and len(routes) == 0


def test_refused_requests_and_aborts_go_back_to_their_sender():
    routes = ClientRoutes(2)
    routes.add("x", [], 1)  # how the core routes an add before it knows the sequences (a refusal reaches it)
    zero, one = routes.split(CoreOutputs(asleep=["x"]), [])
    assert one.asleep == ["x"] and zero.asleep == [] and len(routes) == 0
    routes.add("y", ["y"], 0)
    routes.forget("y")  # aborted
    assert routes.split(CoreOutputs(req_ids=["y"], token_ids=[3]), [])[0].req_ids == []
