"""The step's host->device copy (model_runner_v2/input_batch.py): one packed copy whose every part starts 16-byte
aligned, so a Triton kernel sees the same pointer alignment whatever the batch size (with an odd batch size the
old packing put query_start_loc at an 8-byte offset, and the prefill kernel compiled a second variant inside a
user's run, on a fresh GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayllm.model_runner_v2.input_batch import _to_device, prepare_inputs
from replayllm.model_runner_v2.request_states import RequestStates


@pytest.mark.parametrize("lengths", [[1], [3, 1, 2], [5, 4, 4, 1, 7], [2, 2]])
def test_parts_keep_their_values_and_start_aligned(lengths):
    rng = np.random.default_rng(sum(lengths))
    parts = [rng.integers(-2**40, 2**40, size=n, dtype=np.int64) for n in lengths]
    views = _to_device(parts, torch.device("cpu"))
    base = views[0].data_ptr()
    for part, view in zip(parts, views):
        assert view.dtype == torch.int64 and view.tolist() == part.tolist()
        assert (view.data_ptr() - base) % 16 == 0


@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 8])
def test_attention_pointers_are_aligned_for_any_batch_size(num_rows):
    states = RequestStates(max_num_reqs=8, max_model_len=64, max_blocks_per_seq=4, device=torch.device("cpu"))
    slots = [states.add_request(f"r{i}", list(range(1, 6 + i)), 5 + i, [i]) for i in range(num_rows)]
    states.apply_staged_writes()
    computed = np.zeros(num_rows, dtype=np.int64)
    scheduled = np.array([5 + i for i in range(num_rows)], dtype=np.int64)
    batch = prepare_inputs(states, np.array(slots), computed, scheduled, np.ones(num_rows, dtype=np.int64), 16)
    md = batch.attn
    assert md.query_start_loc.tolist() == [0, *np.cumsum(scheduled).tolist()]
    assert md.seq_lens.tolist() == scheduled.tolist()
    base = md.query_start_loc.data_ptr() - md.query_start_loc.storage_offset() * 8  # the packed copy's start
    for t in (md.query_start_loc, md.seq_lens, md.token_req_idx, md.positions):
        assert (t.data_ptr() - base) % 16 == 0


def test_slot_mapping_and_input_ids_follow_the_device_tables():
    """The slot mapping and the input ids' flat indices are computed on the host, from the host mirror of the
    block table: equal to what the device tables give (block_table[slot, pos // bs] * bs + pos % bs, and
    token_ids[slot, pos]), for prompts spanning several blocks, blocks appended later and rows in any slot
    order."""
    bs = 4
    states = RequestStates(max_num_reqs=4, max_model_len=32, max_blocks_per_seq=8, device=torch.device("cpu"))
    rng = np.random.default_rng(3)
    prompts = {0: rng.integers(1, 500, 9).tolist(), 1: rng.integers(1, 500, 3).tolist()}
    states.add_request("free", [1, 2], 2, [30])  # slot 0, freed: its slot's rows must not leak into others
    states.remove_request("free")
    slot_a = states.add_request("a", prompts[0], 9, [7, 2, 11])
    slot_b = states.add_request("b", prompts[1], 3, [5])
    states.append_blocks(slot_b, [9])
    states.apply_staged_writes()
    slots = np.array([slot_b, slot_a])
    computed = np.array([2, 5], dtype=np.int64)
    scheduled = np.array([3, 4], dtype=np.int64)  # b: positions 2..4 (crosses into block 9), a: 5..8
    batch = prepare_inputs(states, slots, computed, scheduled, np.array([1, 1]), bs)
    token_slots = torch.tensor(np.repeat(slots, scheduled))
    positions = torch.tensor(np.concatenate([np.arange(c, c + s) for c, s in zip(computed, scheduled)]))
    want = states.block_table[token_slots, positions // bs].long() * bs + positions % bs
    assert batch.attn.slot_mapping.tolist() == want.tolist()
    assert batch.input_ids.tolist() == states.token_ids[token_slots, positions].long().tolist()
    assert batch.attn.slot_mapping.dtype == torch.int64 and batch.input_ids.dtype == torch.int64


def test_every_token_sampled_only_when_the_logits_rows_are_all_the_tokens():
    """A decode step samples every token in order (the runner then feeds the hidden rows to the LM head without
    a gather); a prefill chunk that samples its last token only, or a partial prefill, does not."""
    states = RequestStates(max_num_reqs=4, max_model_len=32, max_blocks_per_seq=4, device=torch.device("cpu"))
    slots = np.array([states.add_request(f"r{i}", [1, 2, 3, 4, 5], 5, [i]) for i in range(3)])
    states.apply_staged_writes()
    ones = np.ones(3, dtype=np.int64)
    decode = prepare_inputs(states, slots, np.full(3, 4), ones, ones, 16)
    assert decode.every_token_sampled and decode.logits_indices.tolist() == [0, 1, 2]
    prefill = prepare_inputs(states, slots, np.zeros(3, dtype=np.int64), np.full(3, 5), ones, 16)
    assert not prefill.every_token_sampled and prefill.logits_indices.tolist() == [4, 9, 14]
    partial = prepare_inputs(states, slots, np.full(3, 4), ones, np.array([1, 0, 1]), 16)
    assert not partial.every_token_sampled and partial.logits_indices.tolist() == [0, 2]
