"""The decode launch rules (`kernels/decode_launch.py`): the tile per dtype and grid size, the split count per
batch shape and SM count, and their environment overrides. Pure functions of their arguments: no kernel runs
(the kernel under these rules: tests/kernels/test_paged_attention.py)."""

from __future__ import annotations

import pytest
import torch

from replayllm.kernels import decode_launch as dl


def test_decode_tile_choice_and_override(monkeypatch):
    """16-bit dtypes: narrow one-warp tiles once the grid has many programs of at most 16 q heads, the 4-warp tile
    for few or for wide groups; fp32 keeps its spill-free tile; 16-bit heads over 128 wide their measured tile;
    REPLAYLLM_DECODE_TILE forces a tile and a malformed value is an error."""
    monkeypatch.delenv(dl._DECODE_TILE_ENV, raising=False)
    assert dl.decode_tile(torch.bfloat16, 128, 256 * 8) == dl._DECODE_TILE_NARROW
    assert dl.decode_tile(torch.bfloat16, 128, 256 * 8, group=16) == dl._DECODE_TILE_NARROW
    assert dl.decode_tile(torch.bfloat16, 64, 256 * 8, group=71) == dl._DECODE_TILE_WIDE  # Falcon-7B
    assert dl.decode_tile(torch.bfloat16, 128, 8) == dl._DECODE_TILE_WIDE
    assert dl.decode_tile(torch.float32, 128, 256 * 8) == (32, 8, 3)
    assert dl.decode_tile(torch.float32, 256, 256 * 8) == (32, 8, 3)
    assert dl.decode_tile(torch.bfloat16, 256, 256 * 8) == dl._DECODE_TILE_WIDE_HEAD == (32, 4, 2)
    monkeypatch.setenv(dl._DECODE_TILE_ENV, "16,2,2")
    assert dl.decode_tile(torch.bfloat16, 128, 8) == (16, 2, 2)
    monkeypatch.setenv(dl._DECODE_TILE_ENV, "16,2")
    with pytest.raises(ValueError, match="REPLAYLLM_DECODE_TILE"):
        dl.decode_tile(torch.bfloat16, 128, 8)


def test_decode_num_splits_rule(monkeypatch):
    """A pure function of (sequences, kv heads, max_seq_len, SM count): batches with at least one (sequence,
    kv head) pair per SM keep the 256-key rule (W1: one split); fewer pairs take 64-key chunks (the env var
    overrides that minimum); without an SM count (CPU) the 256-key rule alone."""
    monkeypatch.delenv(dl._SMALL_SPLIT_ENV, raising=False)
    assert dl.decode_min_split_len(256, 8, 132) == dl.decode_min_split_len(17, 8, 132) == 256
    assert dl.decode_num_splits(256, 8, 40960, 132) == 1
    assert dl.decode_num_splits(17, 8, 40960, 132) == 2  # cdiv(2 * 132, 136)
    assert dl.decode_num_splits(17, 8, 300, 132) == 2  # cdiv(300, 256)
    assert dl.decode_min_split_len(1, 8, 132) == dl.decode_min_split_len(16, 8, 132) == 64
    assert dl.decode_num_splits(1, 8, 40960, 132) == 32  # a CUDA graph's max_model_len: DECODE_MAX_SPLITS
    assert dl.decode_num_splits(1, 8, 700, 132) == 11  # cdiv(700, 64); 3 with 256-key chunks
    assert dl.decode_num_splits(16, 8, 40960, 132) == 3  # cdiv(2 * 132, 128)
    assert dl.decode_min_split_len(1, 8, None) == 256
    assert dl.decode_num_splits(1, 8, 300, None) == 2
    monkeypatch.setenv(dl._SMALL_SPLIT_ENV, "256")
    assert dl.decode_num_splits(1, 8, 700, 132) == 3
    monkeypatch.setenv(dl._SMALL_SPLIT_ENV, "0")
    with pytest.raises(ValueError, match="REPLAYLLM_DECODE_SMALL_SPLIT"):
        dl.decode_num_splits(1, 8, 700, 132)
    # REPLAYLLM_DECODE_MIN_SPLIT: the large-batch minimum (an A/B switch), the small-batch one untouched
    monkeypatch.delenv(dl._SMALL_SPLIT_ENV)
    monkeypatch.setenv(dl._MIN_SPLIT_ENV, "64")
    assert dl.decode_min_split_len(256, 1, 132) == 64 and dl.decode_min_split_len(1, 8, 132) == 64
    assert dl.decode_num_splits(256, 1, 8192, 132) == 2 and dl.decode_min_split_len(256, 1, None) == 64
    monkeypatch.setenv(dl._MIN_SPLIT_ENV, "x")
    with pytest.raises(ValueError, match="REPLAYLLM_DECODE_MIN_SPLIT"):
        dl.decode_min_split_len(256, 8, 132)


def test_reduce_rows_rule(monkeypatch):
    """Host ints only: one row a program below 8,192 (sequence, q head) rows (StarCoderBase-1B's 16 heads at 256
    sequences, Falcon-7B's 71 at batch 1), 8 from there (Falcon-7B at 256); REPLAYLLM_DECODE_REDUCE_ROWS overrides it
    (capped at the head count), a bad value errors."""
    monkeypatch.delenv(dl._REDUCE_ROWS_ENV, raising=False)
    assert dl.reduce_rows(256, 16) == dl.reduce_rows(1, 71) == dl.reduce_rows(64, 71) == 1
    assert dl.reduce_rows(256, 71) == dl.reduce_rows(128, 64) == 8
    monkeypatch.setenv(dl._REDUCE_ROWS_ENV, "4")
    assert dl.reduce_rows(1, 16) == 4 and dl.reduce_rows(1, 2) == 2
    monkeypatch.setenv(dl._REDUCE_ROWS_ENV, "0")
    with pytest.raises(ValueError, match="REPLAYLLM_DECODE_REDUCE_ROWS"):
        dl.reduce_rows(1, 16)
