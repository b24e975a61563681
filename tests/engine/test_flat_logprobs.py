"""FlatLogprobs: per-token logprobs stored flat, read like list[dict[int, Logprob]] (positions built on read)."""

import pytest

from replayllm.outputs import FlatLogprobs, Logprob


def _flat(k=2, decode=None):
    f = FlatLogprobs(k, decode)
    f.append_token(7, -0.5, 1, [7, 3, 9], [-0.5, -1.5, -2.0])  # the chosen token is the top-1
    f.append_token(4, -3.0, 5, [1, 2, 8], [-0.1, -0.2, -0.9])  # a forced token far down
    return f


def test_reads_like_a_list_of_dicts():
    f = _flat()
    want = [{7: Logprob(-0.5, 1), 3: Logprob(-1.5, 2)},
            {4: Logprob(-3.0, 5), 1: Logprob(-0.1, 1), 2: Logprob(-0.2, 2)}]
    assert len(f) == 2 and f == want and want == f and list(f) == want
    assert f[-1] == want[1] and f[0:1] == want[:1] and f[5:] == []
    assert list(f[0]) == [7, 3]  # the chosen token first, then the alternatives
    with pytest.raises(IndexError):
        f[2]
    assert f != want[:1] and (f == "x") is False


def test_decode_and_k_zero():
    f = _flat(k=0, decode=lambda t: f"<{t}>")
    assert f[1] == {4: Logprob(-3.0, 5, "<4>")}


def test_snapshot_does_not_grow_and_is_read_only():
    f = _flat()
    snap = f.snapshot()
    f.append_token(5, -1.0, 2, [6, 5], [-0.7, -1.0])
    assert len(snap) == 2 and len(f) == 3 and snap == f[:2]
    assert f[2] == {5: Logprob(-1.0, 2), 6: Logprob(-0.7, 1)}
    with pytest.raises(ValueError, match="read-only"):
        snap.append_token(1, -1.0, 1, [], [])
    again = snap.snapshot()  # the in-process server snapshots an output's snapshot once more
    assert len(again) == 2 and again == f[:2] and again[0:2] == f[:2]


def test_append_from_a_steps_flat_rows():
    """The engine hands each row its slice of the step's flat [R * K] top-k lists (start = row * K, K = the
    batch's widest top-k >= this request's k): the stored positions equal a per-row append."""
    flat_ids, flat_lps = [7, 3, 9, 1, 2, 8], [-0.5, -1.5, -2.0, -0.1, -0.2, -0.9]  # R = 2 rows, K = 3
    f = FlatLogprobs(2)
    f.append_token(7, -0.5, 1, flat_ids, flat_lps, 0)
    f.append_token(4, -3.0, 5, flat_ids, flat_lps, 3)
    assert f == _flat()


@pytest.mark.parametrize("k,stride", [(2, 2), (1, 3), (0, 2)])
def test_extend_tokens_equals_appending_one_by_one(k, stride):
    """A fast-replay row's chunk in one call, its top-k read from the step's flat lists at `stride` per token
    (the step's widest k), from `start` on: the same columns and positions as n append_token calls."""
    tokens, lps, ranks = [5, 8, 2], [-0.25, -1.5, -3.0], [1, 4, 9]
    ids = list(range(100, 100 + 2 * stride + 3 * stride))  # two earlier rows' entries, then this row's
    vals = [-0.1 * i for i in range(len(ids))]
    start = 2 * stride
    one = FlatLogprobs(k)
    for j in range(3):
        one.append_token(tokens[j], lps[j], ranks[j], ids, vals, start + j * stride)
    bulk = FlatLogprobs(k)
    bulk.extend_tokens(tokens, lps, ranks, ids, vals, start, stride)
    assert bulk.columns() == one.columns() and list(bulk) == list(one) and len(bulk) == 3
