"""The token-id prompt checks on the request path (engine/input_processor.py check_prompt_token_ids and the
server's text walk, entrypoints/openai/input_check.py): their fast paths for plain-int lists accept and refuse
exactly what the element-by-element checks do."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from replayllm.engine.input_processor import check_prompt_token_ids, plain_ints
from replayllm.entrypoints.openai.input_check import _walk


class Tok(enum.IntEnum):
    A = 5


@pytest.mark.parametrize("ids", [[3, 1, 4], (3, 1, 4), [Tok.A, 2], [0, 9]])
def test_int_lists_pass_as_lists(ids):
    got = check_prompt_token_ids(ids, vocab_size=10)
    assert got == [int(t) for t in ids] and type(got) is list and got is not ids


@pytest.mark.parametrize("ids", [[1, True], [False], [1, 2.0], [1, "2"], [np.int64(3)], "123", 5])
def test_non_int_elements_are_refused(ids):
    with pytest.raises(ValueError, match="must be a list of integers"):
        check_prompt_token_ids(ids, vocab_size=10)


def test_empty_and_out_of_range_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        check_prompt_token_ids([], vocab_size=10)
    with pytest.raises(ValueError, match=r"in \[0, 10\), got \[10, -1\]"):
        check_prompt_token_ids([1, 10, -1], vocab_size=10)


def test_walk_skips_only_plain_int_lists():
    assert list(_walk([1, 2, 3], ["prompt"])) == []
    assert list(_walk([1, "x"], ["prompt"])) == [(["prompt", "1"], "x")]
    assert list(_walk([True, "y"], ["p"])) == [(["p", "1"], "y")]  # a bool first: walked, not skipped
    assert list(_walk([["a"], 1], ["p"])) == [(["p", "0", "0"], "a")]


def test_plain_ints_means_exactly_int():
    assert plain_ints([1, 2]) and plain_ints((3,)) and plain_ints([])
    assert not plain_ints([1, True]) and not plain_ints([Tok.A]) and not plain_ints([np.int64(1)])
