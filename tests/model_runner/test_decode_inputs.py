"""model_runner_v2/decode_inputs.py: a decode step's inputs written straight into the decode graphs' buffers must
be the general input path's (input_batch.prepare_inputs) for the same step, and padding rows must point at the
sink. CPU tensors: the layout and the gathers the graph runs are the same code on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayllm.model_runner_v2.decode_inputs import SEQ_LENS, SLOT_MAPPING, SLOTS, DecodeInputs
from replayllm.model_runner_v2.input_batch import prepare_inputs
from replayllm.model_runner_v2.request_states import RequestStates

BS, SINK = 8, 99


def _states() -> tuple[RequestStates, list[int]]:
    """Six requests of 3 .. 40 known tokens, blocks scattered over the cache."""
    states = RequestStates(max_num_reqs=6, max_model_len=64, max_blocks_per_seq=8, device=torch.device("cpu"),
                           pad_block=SINK)
    rng = np.random.default_rng(0)
    lengths = [3, 40, 17, 8, 25, 9]
    for i, n in enumerate(lengths):
        blocks = rng.choice(90, size=-(-(n + 1) // BS), replace=False).tolist()
        states.add_request(f"r{i}", rng.integers(0, 1000, size=n).tolist(), n, blocks)
    states.apply_staged_writes()
    return states, lengths


@pytest.mark.parametrize("order, sampled", [([0], [1]), ([4, 1, 2], [1, 1, 1]), ([5, 3, 0, 2, 1], [1, 0, 1, 1, 0]),
                                            ([2, 0, 1, 3], [1, 1, 1, 1])])
def test_equal_to_the_general_input_path(order, sampled):
    states, lengths = _states()
    inputs = DecodeInputs(states, [1, 2, 4, 8], BS, SINK)
    slots = np.array([states.req_id_to_slot[f"r{i}"] for i in order], dtype=np.int64)
    num_computed = np.array([lengths[i] - 1 for i in order], dtype=np.int64)  # feeding each row's last token
    num_sampled = np.array(sampled, dtype=np.int64)
    n = len(order)
    size = next(s for s in inputs.sizes if s >= n)
    want = prepare_inputs(states, slots, num_computed, np.ones(n, dtype=np.int64), num_sampled, BS)
    got = inputs.prepare(slots, num_computed, num_sampled, size)
    inputs.gather(size)  # what the graph runs first
    assert got.graph_size == size and want.graph_size is None
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.attn.seq_lens, want.attn.seq_lens)
    assert torch.equal(got.attn.slot_mapping, want.attn.slot_mapping)
    width = want.attn.block_tables.shape[1]
    assert torch.equal(got.attn.block_tables[:, :width], want.attn.block_tables)
    assert torch.equal(got.logits_indices, want.logits_indices) and torch.equal(got.sample_slots, want.sample_slots)
    assert got.every_token_sampled == want.every_token_sampled == all(sampled)
    assert got.attn.max_seq_len == want.attn.max_seq_len and got.attn.max_query_len == 1
    for name in ("host_slots", "host_sample_rows", "host_query_start_loc", "host_positions_start"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert np.array_equal(got.host_sample_slots, want.host_sample_slots)
    # Rows [n, size): the pad slot (whose table is the sink block), length 1, KV slot in the sink block.
    packed = inputs.packed[size]
    assert (packed[SLOTS, n:] == states.pad_slot).all() and (packed[SEQ_LENS, n:] == 1).all()
    assert (packed[SLOT_MAPPING, n:] == SINK * BS).all() and (inputs.block_tables[n:size] == SINK).all()


def test_a_smaller_step_resets_the_rows_a_larger_one_used():
    states, lengths = _states()
    inputs = DecodeInputs(states, [1, 2, 4, 8], BS, SINK)
    ones = np.ones(8, dtype=np.int64)
    big = np.array([0, 1, 2, 3], dtype=np.int64)
    inputs.prepare(big, np.array([lengths[s] - 1 for s in big]), ones[:4], 4)
    inputs.gather(4)
    assert (inputs.block_tables[3] != SINK).any()
    inputs.prepare(big[:1], np.array([lengths[0] - 1]), ones[:1], 4)
    inputs.gather(4)
    packed = inputs.packed[4]
    assert packed[SLOTS].tolist() == [0, states.pad_slot, states.pad_slot, states.pad_slot]
    assert (inputs.block_tables[1:4] == SINK).all() and (packed[SLOT_MAPPING, 1:] == SINK * BS).all()


def test_the_pad_slot_is_no_request_slot():
    states, _ = _states()
    assert states.pad_slot == states.max_num_reqs == 6
    assert states.block_table.shape[0] == states.host_block_table.shape[0] == 7
    assert (states.block_table[6] == SINK).all() and (states.host_block_table[6] == SINK).all()
    fresh = RequestStates(max_num_reqs=6, max_model_len=64, max_blocks_per_seq=8, device=torch.device("cpu"))
    assert sorted(fresh.free_slots) == list(range(6)) and (fresh.block_table[fresh.pad_slot] == 0).all()
