"""model_runner_v2/step_upload.py: a step's staged writes reach the device in one packed copy, bit for bit what each
writer staged (mixed dtypes and shapes), and the runner's states end up exactly as with per-writer copies. The packing
(PinnedRing.upload, shared with the step's inputs) runs here on CPU; on CUDA, tests/model_runner/test_step_sync_gpu.py
checks that a step admitting requests no longer synchronises the stream."""

from __future__ import annotations

import numpy as np
import torch

from replayllm.model_runner_v2.pinned_ring import PinnedRing
from replayllm.model_runner_v2.request_states import RequestStates
from replayllm.model_runner_v2.step_upload import StepUpload
from replayllm.sampling.sampler import Sampler
from replayllm.sampling.staged_writes import DirectUpload
from replayllm.sampling_params import SamplingParams


class CountingRing(PinnedRing):
    """PinnedRing (on CPU it packs into a fresh host array and wraps it: the packing, no copy) counting its sends."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.sends = 0

    def send(self, n: int) -> torch.Tensor:
        self.sends += 1
        return super().send(n)


def test_arrays_of_any_dtype_and_shape_arrive_bit_for_bit_in_add_order():
    rng = np.random.default_rng(0)
    sent = [
        [rng.integers(-2**62, 2**62, size=3, dtype=np.int64), rng.random(5, dtype=np.float32)],
        [np.array([True, False, True]), np.zeros(0, dtype=np.int64)],
        [rng.integers(-2**31, 2**31, size=(2, 7), dtype=np.int32), np.array([np.nan, -0.0, 1e-40], dtype=np.float32)],
        [rng.integers(0, 255, size=9, dtype=np.uint8).astype(np.int16)],
    ]
    received = []
    ring = CountingRing()
    upload = StepUpload(torch.device("cpu"), ring)
    for arrays in sent:
        upload.add(arrays, lambda *tensors: received.append(tensors))
    upload.flush()
    assert ring.sends == 1
    assert len(received) == len(sent)
    base = received[0][0].data_ptr()  # the packed buffer's start
    for arrays, tensors in zip(sent, received):
        assert len(arrays) == len(tensors)
        for a, t in zip(arrays, tensors):
            assert t.shape == a.shape and t.numpy().dtype == a.dtype
            assert t.numpy().tobytes() == a.tobytes()
            assert (t.data_ptr() - base) % 16 == 0  # every part from a 16-byte boundary, whatever came before
    upload.flush()  # nothing added: no copy
    assert ring.sends == 1


def _staged(upload):
    """A runner's per-slot state after three requests are admitted (prompts, blocks, sampling options, a logit
    bias, an allowed-token list, a trace) and one step's appended blocks, written through `upload`."""
    states = RequestStates(max_num_reqs=4, max_model_len=64, max_blocks_per_seq=8, device=torch.device("cpu"))
    sampler = Sampler(4, 64, torch.device("cpu"), enable_trace_replay=True)
    params = [SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=3, logit_bias={5: -2.5}),
              SamplingParams(max_tokens=5, allowed_token_ids=[1, 2, 9], presence_penalty=0.5, min_p=0.1),
              SamplingParams(trace_decode_token_ids=[4, 8, 15, 16, 23, 42], logprobs=2)]
    for i, p in enumerate(params):
        slot = states.add_request(f"r{i}", list(range(3, 10 + i)), 7 + i, [2 * i, 2 * i + 1])
        sampler.add_request(slot, p, 100 + i, (2,), [])
    for apply in (states.apply_staged_writes, sampler.apply_staged_writes):
        apply(upload)
    if isinstance(upload, StepUpload):
        upload.flush()
    states.append_blocks(1, [6])
    states.apply_staged_writes(upload)
    if isinstance(upload, StepUpload):
        upload.flush()
    bias = sampler.states.logit_bias
    writers = [*sampler.states._all, *sampler.thinking._all, bias.num_bias, bias.bias_token_ids, bias.bias_values,
               bias.num_allowed, bias.allowed_token_ids]
    return [states.token_ids, states.block_table, states.prompt_len.tensor, states.total_len.tensor,
            sampler.trace.trace, sampler.trace.trace_len, *(w.tensor for w in writers)]


def test_the_runner_states_equal_per_writer_copies_with_one_copy_a_step():
    ring = CountingRing()
    packed = _staged(StepUpload(torch.device("cpu"), ring))
    direct = _staged(DirectUpload(torch.device("cpu")))
    assert ring.sends == 2  # one per step that staged anything, not one per writer
    assert len(packed) == len(direct) > 10
    for a, b in zip(packed, direct):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert packed[0][0, :7].tolist() == list(range(3, 10)) and packed[1][1, :3].tolist() == [2, 3, 6]
