"""BlockManager and Scheduler: plain-Python policy, tested without a model."""

from __future__ import annotations

import hashlib
import struct

from replayllm.engine.block_manager import BlockManager
from replayllm.engine.request import Request, RequestStatus
from replayllm.engine.scheduler import Scheduler
from replayllm.sampling_params import SamplingParams


def _req(rid: str, n: int, max_tokens: int = 4, base: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(rid, [base + i for i in range(n)], params, seed=0, eos_token_ids=(9999,), arrival=0)


def test_allocate_free_and_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = _req("a", 10)
    assert bm.allocate_slots(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate_slots(_req("b", 40), 40)  # all or nothing
    assert bm.num_free_blocks == 5
    bm.free_request(r)
    assert bm.num_free_blocks == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_cache_hit_shares_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _req("a", 12)
    bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = _req("b", 12)  # identical prompt: 2 full blocks can be reused, the last must be recomputed
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate_slots(b, 4, hits)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert bm.blocks[a.block_ids[0]].ref_count == 2
    c = _req("c", 12, base=100)  # different tokens: no hit
    assert bm.get_computed_blocks(c) == []
    # After both are freed the cached blocks survive until reused; a later identical prompt still hits.
    bm.free_request(a)
    bm.free_request(b)
    d = _req("d", 12)
    assert len(bm.get_computed_blocks(d)) == 2


def test_chained_hash_depends_on_prefix():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = _req("a", 6)
    bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    b = Request("b", [50, 51, 2, 3, 4, 5], a.params, 0, (9999,), 0)  # same later blocks, other first block
    assert bm.get_computed_blocks(b) == []


def test_block_key_is_sha256_of_the_documented_bytes():
    """The key of block i is sha256(key of block i-1 (32 zero bytes before the first) || the number of ids as
    uint64 LE || each id as int64 LE): engine/block_hash.py's docstring, byte for byte."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _req("a", 9, base=100)
    bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    parent = bytes(32)
    for i in range(2):
        ids = a.token_ids[i * 4 : (i + 1) * 4]
        parent = hashlib.sha256(parent + struct.pack("<Q", 4) + b"".join(struct.pack("<q", t) for t in ids)).digest()
        assert bm.blocks[a.block_ids[i]].block_hash == parent
        assert bm.cached[parent] == a.block_ids[i]
    assert len(bm.cached) == 2  # the partial third block is not published


def test_python_hash_collisions_do_not_share_blocks():
    """CPython hashes an int modulo 2**61 - 1, so 7 and 7 + (2**61 - 1) hash alike, and so do tuples of them: a
    key built with hash() would hand b a's cached blocks (vLLM's CVE-2025-25183). The sha256 key does not."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _req("a", 12)
    bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    twin = [t + (2**61 - 1) for t in a.token_ids]
    assert hash((None, tuple(twin[:4]))) == hash((None, tuple(a.token_ids[:4])))  # the collision is real
    b = Request("b", twin, a.params, 0, (9999,), 0)
    assert bm.get_computed_blocks(b) == []
    assert bm.get_computed_blocks(_req("c", 12)) == a.block_ids[:2]  # the same tokens still hit


def test_forced_routes_salt_the_chain():
    """A request forcing MoE routes starts its chain from a key of those routes: it shares no block with a plain
    request, and shares them with one forcing the very same routes."""
    import numpy as np

    bm = BlockManager(num_blocks=16, block_size=4)
    routes = np.zeros((8, 2, 1), dtype=np.int32)
    forced = SamplingParams(max_tokens=4, temperature=0, trace_routed_experts=routes)
    a = Request("a", list(range(12)), forced, 0, (9999,), 0)
    bm.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert bm.get_computed_blocks(_req("plain", 12)) == []
    same = Request("b", list(range(12)), SamplingParams(max_tokens=4, temperature=0,
                                                        trace_routed_experts=routes.copy()), 0, (9999,), 0)
    assert bm.get_computed_blocks(same) == a.block_ids[:2]
    other = routes.copy()
    other[3, 1, 0] = 1
    c = Request("c", list(range(12)), SamplingParams(max_tokens=4, temperature=0, trace_routed_experts=other),
                0, (9999,), 0)
    assert bm.get_computed_blocks(c) == []


def _sched(num_blocks=64, budget=32, max_seqs=8, chunked=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), max_seqs, budget, 128, chunked)


def _run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {r.request_id: token for r in out.rows if r.samples})
    return out


def test_chunked_prefill_splits_and_samples_only_at_the_end():
    s = _sched(budget=8)
    s.add_request(_req("a", 20))
    out1 = _run_step(s)
    assert [(r.num_scheduled_tokens, r.samples) for r in out1.rows] == [(8, False)]
    out2 = _run_step(s)
    assert [(r.num_computed_tokens, r.num_scheduled_tokens, r.samples) for r in out2.rows] == [(8, 8, False)]
    out3 = _run_step(s)
    assert [(r.num_scheduled_tokens, r.samples) for r in out3.rows] == [(4, True)]
    assert s.requests["a"].num_output_tokens == 1


def test_continuous_batching_respects_limits():
    s = _sched(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(_req(str(i), 5, max_tokens=2))
    out = s.schedule()
    assert len(out.rows) == 2 and len(s.waiting) == 1  # max_num_seqs
    s.update(out, {r.request_id: 7 for r in out.rows})
    out = _run_step(s)  # both finish (max_tokens=2) -> the third gets in next step
    assert all(s.requests.get(r.request_id) is None for r in out.rows)
    out = s.schedule()
    assert [r.request_id for r in out.rows] == ["2"] and set(out.freed_request_ids) == {"0", "1"}
    s.update(out, {"2": 7})


def test_preemption_by_recompute_when_blocks_run_out():
    s = _sched(num_blocks=6, budget=64)
    s.add_request(_req("a", 8, max_tokens=12))  # 5 blocks each at most: one always fits
    s.add_request(_req("b", 8, max_tokens=12))
    _run_step(s)  # both prefilled: 2 + 2 blocks
    for _ in range(10):
        out = _run_step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    b = s.requests["b"]  # the latest arrival is the victim
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.block_ids == []
    assert "b" in out.freed_request_ids and [r.request_id for r in out.rows] == ["a"]  # runner drops b's slot
    out = _run_step(s)  # b comes back as a new request carrying prompt + outputs so far, all recomputed
    row_b = [r for r in out.rows if r.request_id == "b"]
    if row_b:
        assert row_b[0].new_request is not None and row_b[0].new_request.token_ids == b.token_ids[: len(
            row_b[0].new_request.token_ids)]
        # Its own freed blocks are still in the prefix cache, so only the tail is recomputed.
        assert row_b[0].num_computed_tokens % 4 == 0 and row_b[0].samples
    while s.has_unfinished():
        _run_step(s)


def test_abort_frees_blocks():
    s = _sched()
    s.add_request(_req("a", 10))
    _run_step(s)
    assert s.block_manager.num_free_blocks < 64
    s.abort("a")
    assert s.block_manager.num_free_blocks == 64 and not s.has_unfinished()
    assert s.abort("missing") is None


def test_stop_rules_eos_stop_ids_min_tokens():
    s = _sched()
    p = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[5], temperature=0)
    r = Request("a", [1, 2, 3], p, 0, (9,), 0)
    s.add_request(r)
    _run_step(s, token=9)  # EOS under min_tokens: ignored
    assert not r.is_finished
    _run_step(s, token=5)  # stop id at min_tokens: stops
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 5


def test_eos_stops_unless_ignore_eos():
    s = _sched()
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0), 0, (9,), 0)
    b = Request("b", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), 0, (9,), 0)
    s.add_request(a)
    s.add_request(b)
    _run_step(s, token=9)
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert not b.is_finished
    while s.has_unfinished():
        _run_step(s, token=9)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 5
