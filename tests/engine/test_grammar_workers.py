"""GrammarWorkers: a structured step's bitmask fill split over threads, and its batched accept, give exactly what one
matcher at a time gives (bits, acceptance, later states), rejected tokens are reported by row, and the thread count
follows the cores."""

from __future__ import annotations

import numpy as np
import pytest

from replayllm.embedded_model import materialize
from replayllm.engine import grammar_workers
from replayllm.engine.grammar_workers import GrammarWorkers, default_num_threads, matcher_handles
from replayllm.engine.structured_output_manager import StructuredOutputManager, accept_tokens
from replayllm.structured_outputs import StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

VOCAB = 151936  # Qwen3's logits width
EOS = (151645, 151643)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "score", "tags"]}
# Grammar states of every cost: the start, whitespace, inside strings (xgrammar's slow path), an escape, a number.
PREFIXES = ["", "{", '{\n  ', '{"name": "', '{"name": "ab c', '{"name": "x\\', '{"name": "x", "score": 1',
            '{"name": "x", "score": 1.5, "tags": [', '{"name": "x", "score": 1, "tags": ["q']


@pytest.fixture(scope="module")
def manager():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(materialize("replayllm/tiny-qwen3"))
    m = StructuredOutputManager(tokenizer, VOCAB, EOS, num_threads=3)
    yield m
    m.shutdown()


def _grammars(manager, n: int) -> list:
    """n grammars of the schema, row i advanced by PREFIXES[i % len(PREFIXES)]."""
    spec = StructuredOutputsParams(json=SCHEMA)
    out = []
    for i in range(n):
        g = manager.add_request(spec)
        g.wait(120)
        assert g.matcher.accept_string(PREFIXES[i % len(PREFIXES)])
        out.append(g)
    return out


def _serial_bits(matchers) -> np.ndarray:
    bits = np.zeros((len(matchers), (VOCAB + 31) // 32), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bits, i)
    return bits


def test_parallel_fill_equals_one_matcher_at_a_time(manager):
    grammars = _grammars(manager, 50)  # chunks of 8 rows over 3 threads
    matchers = [g.matcher for g in grammars]
    bits = np.full((50, (VOCAB + 31) // 32), 12345, dtype=np.int32)  # stale words: every one must be rewritten
    workers = GrammarWorkers(3)
    workers.fill(matcher_handles(matchers), bits)
    assert len(workers._chunks(50)) > 3 and workers.stats.fill_rows == 50 and workers.stats.fill_calls == 1
    np.testing.assert_array_equal(bits, _serial_bits(matchers))
    # The states really differ: 9 prefixes, 7 masks ('{' = '{\n  ' and the two mid-"name" prefixes coincide).
    assert len({bits[i].tobytes() for i in range(len(PREFIXES))}) == 7


def test_fill_thread_equals_one_matcher_at_a_time(manager):
    """start_fill (async steps: one xgrammar call with its own pool, on the fill thread) writes the same bits, and
    the fill thread serves fill after fill until shutdown."""
    grammars = _grammars(manager, 50)
    matchers = [g.matcher for g in grammars]
    workers = GrammarWorkers(3, fill_thread_pool_size=3)
    for _ in range(2):
        bits = np.full((50, (VOCAB + 31) // 32), 12345, dtype=np.int32)
        workers.start_fill(matcher_handles(matchers), bits).wait()
        np.testing.assert_array_equal(bits, _serial_bits(matchers))
    assert workers.stats.fill_calls == 2 and workers.stats.fill_rows == 100 and workers.stats.fill_seconds > 0
    workers.shutdown()
    assert workers._jobs is None


def test_a_fill_thread_that_cannot_start_fails_every_fill_instead_of_hanging(monkeypatch):
    class NoPool:
        def BatchGrammarMatcher(self, max_threads):  # noqa: N802 -- xgrammar's name
            raise RuntimeError("no threads here")

    monkeypatch.setattr(grammar_workers, "_xgrammar", lambda: NoPool())
    workers = GrammarWorkers(1)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="fill thread could not start: no threads here"):
            workers.start_fill([], np.zeros((0, 4), dtype=np.int32)).wait()
    workers.shutdown()


@pytest.mark.parametrize("cores, fill_threads", [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 16)])
def test_fill_thread_pool_is_a_quarter_of_the_cores(monkeypatch, cores, fill_threads):
    monkeypatch.setattr(grammar_workers.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(grammar_workers, "_read", lambda path: None)
    assert GrammarWorkers(default_num_threads()).fill_thread_pool_size == fill_threads
    assert GrammarWorkers(1, fill_thread_pool_size=5).fill_thread_pool_size == 5  # asked for: taken as given


def test_parallel_accept_matches_serial_and_reports_rejections(manager):
    grammars = _grammars(manager, 40)
    twins = [g.matcher.fork() for g in grammars]  # the reference advances one matcher at a time
    bits = _serial_bits(twins)
    rng = np.random.default_rng(0)
    tokens = []
    for i in range(40):
        allowed = np.flatnonzero(np.unpackbits(bits[i].view(np.uint8), bitorder="little")[:VOCAB])
        disallowed = np.setdiff1d(np.arange(1000), allowed)
        tokens.append(int(rng.choice(disallowed if i % 7 == 3 else allowed)))  # rows 3, 10, 17, ...: rejected
    accepted = accept_tokens(grammars, tokens)
    assert accepted == [m.accept_token(t) for m, t in zip(twins, tokens)]
    assert [i for i, a in enumerate(accepted) if not a] == list(range(3, 40, 7))
    np.testing.assert_array_equal(_serial_bits([g.matcher for g in grammars]), _serial_bits(twins))


def test_grammar_ends_only_on_a_stop_token(manager):
    g = manager.add_request(StructuredOutputsParams(choice=["yes"]))
    g.wait(120)
    assert g.matcher.accept_string("yes") and not g.ended_by(EOS[0])  # complete, not terminated yet
    assert accept_tokens([g], [EOS[0]]) == [True]
    assert g.ended_by(EOS[0]) and not g.ended_by(12345)


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 14), (64, 16)])
def test_default_num_threads_leaves_two_cores(monkeypatch, cores, threads):
    monkeypatch.setattr(grammar_workers.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(grammar_workers, "_read", lambda path: None)  # no cgroup files: no quota
    assert default_num_threads() == threads


@pytest.mark.parametrize("files, cores", [
    ({"/sys/fs/cgroup/cpu.max": "800000 100000\n"}, 8),  # v2: 8 cores of quota
    ({"/sys/fs/cgroup/cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
    ({"/sys/fs/cgroup/cpu.max": "max 100000\n"}, 64),  # unlimited: the affinity mask
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "400000\n", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 4),
    ({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "/sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"}, 64),
    ({"/sys/fs/cgroup/cpu.max": "garbage\n"}, 64),
])
def test_usable_cores_honours_a_cgroup_quota(monkeypatch, files, cores):
    monkeypatch.setattr(grammar_workers.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(grammar_workers, "_read", files.get)
    assert grammar_workers.usable_cores() == cores


def test_a_chunk_error_is_raised_after_every_chunk_finished():
    workers = GrammarWorkers(3)
    done = []

    def work(lo: int, hi: int) -> None:
        if lo == 16:
            raise RuntimeError("chunk 16")
        done.append(lo)

    with pytest.raises(RuntimeError, match="chunk 16"):
        workers._run(work, 64)
    assert sorted(done) == [lo for lo, _ in workers._chunks(64) if lo != 16]


@pytest.mark.parametrize("bad", [0, -1, 2.0, None])
def test_bad_thread_count_is_a_value_error(bad):
    with pytest.raises(ValueError, match="grammar worker threads"):
        GrammarWorkers(bad)



@pytest.mark.parametrize("bad", [0, -2, 1.5])
def test_bad_fill_thread_pool_size_is_a_value_error(bad):
    with pytest.raises(ValueError, match="fill thread pool size"):
        GrammarWorkers(2, fill_thread_pool_size=bad)
