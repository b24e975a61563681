"""Trace replay kernel (Triton, under the interpreter on CPU) vs its torch reference and explicit values."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from replayllm.kernels.trace_replay import (
    trace_replay,
    trace_replay_torch,
    trace_replay_triton,
    use_triton_trace_kernel,
)
from replayllm.sampling.trace_replay_state import TraceReplayState
from replayllm.sampling_params import SamplingParams

SENTINEL = 999  # every row starts as this "sampled" token; unchanged rows keep it

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU Triton tests need TRITON_INTERPRET=1"
)
IMPLS = [
    pytest.param(trace_replay_triton, id="triton", marks=needs_interpreter),
    pytest.param(trace_replay_torch, id="torch"),
]


def _slots(num_slots, max_len, prompt_lens, total_lens, traces):
    """Build per-slot tensors: trace [S, L] int32 filled from `traces` (None = no trace)."""
    trace = torch.zeros(num_slots, max_len, dtype=torch.int32)
    trace_len = torch.zeros(num_slots, dtype=torch.int32)
    for s, t in enumerate(traces):
        if t is not None:
            trace[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
            trace_len[s] = len(t)
    prompt_len = torch.tensor(prompt_lens, dtype=torch.int32)
    total_len = torch.tensor(total_lens, dtype=torch.int32)
    return total_len, prompt_len, trace, trace_len


def _run(impl, slots, total_len, prompt_len, trace, trace_len):
    sampled = torch.full((len(slots),), SENTINEL, dtype=torch.int64)
    impl(sampled, slots, total_len, prompt_len, trace, trace_len)
    return sampled.tolist()


@pytest.mark.parametrize("impl", IMPLS)
def test_overwrites_at_each_step_and_stops_after_trace(impl):
    # One slot with prompt_len 4 and trace [11, 22, 33]; walk total_len from 3 (partial prompt) to 8.
    trace_tokens = [11, 22, 33]
    expected = {3: SENTINEL, 4: 11, 5: 22, 6: 33, 7: SENTINEL, 8: SENTINEL}
    got = {}
    for total in expected:
        tensors = _slots(1, 8, [4], [total], [trace_tokens])
        got[total] = _run(impl, torch.tensor([0], dtype=torch.int32), *tensors)[0]
    assert got == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_slots_padding_and_non_trace_rows(impl, idx_dtype):
    # Slots: 0 trace at step 1, 1 no trace, 2 trace at step 0, 3 trace exhausted, 4 partial prompt.
    tensors = _slots(
        5,
        6,
        prompt_lens=[2, 3, 5, 1, 4],
        total_lens=[3, 4, 5, 3, 2],
        traces=[[7, 8, 9], None, [40, 41], [5, 6], [70]],
    )
    # Rows gather slots out of order, with padding rows (-1) and a slot used by two rows.
    slots = torch.tensor([2, -1, 1, 0, 3, 4, -1, 0], dtype=idx_dtype)
    got = _run(impl, slots, *tensors)
    assert got == [40, SENTINEL, SENTINEL, 8, SENTINEL, SENTINEL, SENTINEL, 8]


@needs_interpreter
def test_triton_matches_torch_on_random_inputs():
    gen = torch.Generator().manual_seed(0)
    num_slots, max_len, num_rows = 16, 12, 48
    prompt_len = torch.randint(1, 8, (num_slots,), generator=gen, dtype=torch.int32)
    # total_len - prompt_len spans [-2, max_len + 2): negative, in-trace and past-the-end steps.
    total_len = prompt_len + torch.randint(-2, max_len + 2, (num_slots,), generator=gen, dtype=torch.int32)
    trace = torch.randint(0, 50_000, (num_slots, max_len), generator=gen, dtype=torch.int32)
    trace_len = torch.randint(0, max_len + 1, (num_slots,), generator=gen, dtype=torch.int32)
    slots = torch.randint(-1, num_slots, (num_rows,), generator=gen, dtype=torch.int32)
    sampled = torch.randint(0, 50_000, (num_rows,), generator=gen, dtype=torch.int64)

    ref = sampled.clone()
    trace_replay_torch(ref, slots, total_len, prompt_len, trace, trace_len)
    out = sampled.clone()
    trace_replay_triton(out, slots, total_len, prompt_len, trace, trace_len)
    assert torch.equal(out, ref)
    # The inputs really exercise both branches.
    assert (ref != sampled).any() and (ref == sampled).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_non_contiguous_trace_uses_strides(impl):
    # A transposed view: trace[s, j] lives at storage offset j * S + s.
    base = torch.arange(100, 100 + 3 * 5, dtype=torch.int32).reshape(5, 3)
    trace = base.t()  # [3 slots, 5 steps], strides (1, 3)
    trace_len = torch.full((3,), 5, dtype=torch.int32)
    prompt_len = torch.zeros(3, dtype=torch.int32)
    total_len = torch.tensor([0, 2, 4], dtype=torch.int32)
    got = _run(impl, torch.tensor([0, 1, 2], dtype=torch.int64), total_len, prompt_len, trace, trace_len)
    assert got == [trace[0, 0].item(), trace[1, 2].item(), trace[2, 4].item()]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_is_a_no_op(impl):
    tensors = _slots(2, 4, [1, 1], [1, 1], [[5], [6]])
    assert _run(impl, torch.zeros(0, dtype=torch.int32), *tensors) == []


@pytest.mark.parametrize("impl", IMPLS)
def test_validation_errors(impl):
    total_len, prompt_len, trace, trace_len = _slots(2, 4, [1, 1], [1, 1], [[5], None])
    sampled = torch.zeros(3, dtype=torch.int64)
    idx = torch.zeros(3, dtype=torch.int32)
    good = dict(
        sampled=sampled, slots=idx, total_len=total_len, prompt_len=prompt_len, trace=trace,
        trace_len=trace_len,
    )
    bad_cases = [
        ({"sampled": sampled.int()}, "sampled must be torch.int64"),
        ({"slots": idx.float()}, "slots must be torch.int32 or torch.int64"),
        ({"total_len": total_len.long()}, "total_len must be torch.int32"),
        ({"trace": trace.long()}, "trace must be torch.int32"),
        ({"trace": trace[0]}, "trace must be 2-D"),
        ({"slots": idx[:2]}, "slots has 2 rows but sampled has 3"),
        ({"trace_len": trace_len[:1]}, "trace_len has 1 slots but trace has 2 rows"),
        ({"prompt_len": [1, 1]}, "prompt_len must be a torch.Tensor"),
    ]
    for override, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            impl(**{**good, **override})


def test_launcher_rejects_non_contiguous_1d():
    total_len, prompt_len, trace, trace_len = _slots(2, 4, [1, 1], [1, 1], [[5], None])
    sampled = torch.zeros(6, dtype=torch.int64)[::2]
    idx = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="sampled must be contiguous"):
        trace_replay_triton(sampled, idx, total_len, prompt_len, trace, trace_len)


def test_use_triton_trace_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton_trace_kernel(torch.device("cpu"))
    assert use_triton_trace_kernel(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not use_triton_trace_kernel(torch.device("cpu"))
    assert use_triton_trace_kernel(torch.device("cuda"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not use_triton_trace_kernel(torch.device("cpu"))


def test_dispatcher_falls_back_to_torch_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tensors = _slots(1, 4, [2], [3], [[5, 6]])
    assert _run(trace_replay, torch.tensor([0, -1], dtype=torch.int32), *tensors) == [6, SENTINEL]
    with pytest.raises(ValueError, match="cannot run on cpu"):
        _run(trace_replay_triton, torch.tensor([0], dtype=torch.int32), *tensors)


class TestTraceReplayState:
    def _sample(self, state, slots, total_lens, prompt_lens):
        """One sampling step: rows = `slots` (-1 padding); total/prompt lengths per slot."""
        state.apply_staged_writes()
        total_len = torch.tensor(total_lens, dtype=torch.int32)
        prompt_len = torch.tensor(prompt_lens, dtype=torch.int32)
        host_slots = np.asarray(slots, dtype=np.int32)
        sampled = torch.full((len(slots),), SENTINEL, dtype=torch.int64)
        state.apply(sampled, torch.from_numpy(host_slots), total_len, prompt_len, host_slots)
        return sampled.tolist()

    def test_replay_and_slot_reuse_clears_stale_trace(self):
        state = TraceReplayState(max_num_reqs=3, max_model_len=6, device="cpu")
        state.add_request(0, [10, 11, 12])
        state.add_request(1, None)
        assert self._sample(state, [0, 1, -1], [5, 5, 0], [4, 5, 0]) == [11, SENTINEL, SENTINEL]
        assert state.trace_len.tolist() == [3, 0, 0]

        # Slot 0 finishes and is reused in the same step by a request without a trace.
        state.remove_request(0)
        state.add_request(0, None)
        assert not state.has_trace[0]
        assert self._sample(state, [0, 1], [4, 5, 0], [4, 5, 0]) == [SENTINEL, SENTINEL]
        assert state.trace_len.tolist() == [0, 0, 0]

        # Reused without remove_request first: add_request alone must clear the old length.
        state.add_request(2, [1, 2, 3, 4])
        state.apply_staged_writes()
        state.add_request(2, None)
        assert self._sample(state, [2], [0, 0, 7], [0, 0, 4]) == [SENTINEL]

    def test_reuse_by_another_trace_in_one_step_keeps_the_last(self):
        state = TraceReplayState(max_num_reqs=2, max_model_len=4, device="cpu")
        state.add_request(1, [1, 2, 3, 4])
        state.remove_request(1)
        state.add_request(1, [50, 60])
        got = [self._sample(state, [1], [0, p + step], [0, p])[0] for p, step in [(3, 0), (3, 1), (3, 2)]]
        assert got == [50, 60, SENTINEL]
        assert state.trace[1, :2].tolist() == [50, 60]

    def test_any_replaying_skips_the_kernel(self, monkeypatch):
        state = TraceReplayState(max_num_reqs=4, max_model_len=4, device="cpu")
        state.add_request(1, [5])
        state.add_request(2, [])
        assert state.any_replaying(np.array([1, -1]))
        assert not state.any_replaying(np.array([0, 2, 3, -1]))
        assert not state.any_replaying(np.array([], dtype=np.int32))

        import replayllm.sampling.trace_replay_state as module

        calls = []
        monkeypatch.setattr(module, "trace_replay", lambda *args: calls.append(args))
        self._sample(state, [0, 2], [1, 1, 1, 1], [1, 1, 1, 1])
        assert calls == []
        self._sample(state, [0, 1], [1, 1, 1, 1], [1, 1, 1, 1])
        assert len(calls) == 1

    def test_add_request_validation(self):
        """The state checks its slots; the trace's own rules are checked once, at admission (SamplingParams and
        SamplingParams.verify_for_engine), never again per slot or per step."""
        state = TraceReplayState(max_num_reqs=2, max_model_len=3, device="cpu")
        with pytest.raises(ValueError, match="out of range"):
            state.add_request(2, [1])
        with pytest.raises(ValueError, match="out of range"):
            state.remove_request(-1)
        with pytest.raises(ValueError, match="must be >= 1"):
            TraceReplayState(max_num_reqs=0, max_model_len=3, device="cpu")
        with pytest.raises(ValueError, match=r"trace_decode_token_ids\[0\] must be an integer token id"):
            SamplingParams(trace_decode_token_ids=[1.5])
        with pytest.raises(ValueError, match=r"trace_decode_token_ids\[0\] = -3 is negative"):
            SamplingParams(trace_decode_token_ids=[-3])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            SamplingParams(trace_decode_token_ids=[2**31]).verify_for_engine(
                prompt_len=1, max_model_len=3, vocab_size=10, max_logprobs=0, enable_trace_replay=True)
        # Admission truncates a trace to the room max_model_len leaves after the prompt.
        fitted = SamplingParams(trace_decode_token_ids=[1, 2, 3, 4]).verify_for_engine(
            prompt_len=1, max_model_len=3, vocab_size=10, max_logprobs=0, enable_trace_replay=True)
        assert fitted.trace_decode_token_ids == [1, 2]
        assert not state.has_trace.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 runs the interpreter; set TRITON_INTERPRET=0 to test the compiled kernel",
)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_compiled_kernel_matches_torch_on_cuda(idx_dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    num_slots, max_len, num_rows = 1024, 257, 4096
    kw = dict(generator=gen, device="cuda", dtype=torch.int32)
    prompt_len = torch.randint(1, 100, (num_slots,), **kw)
    total_len = prompt_len + torch.randint(-5, max_len + 5, (num_slots,), **kw)
    trace = torch.randint(0, 151_000, (num_slots, max_len), **kw)
    trace_len = torch.randint(0, max_len + 1, (num_slots,), **kw)
    slots = torch.randint(-1, num_slots, (num_rows,), **{**kw, "dtype": idx_dtype})
    sampled = torch.randint(0, 151_000, (num_rows,), generator=gen, device="cuda", dtype=torch.int64)

    ref = sampled.clone()
    trace_replay_torch(ref, slots, total_len, prompt_len, trace, trace_len)
    out = sampled.clone()
    trace_replay_triton(out, slots, total_len, prompt_len, trace, trace_len)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    assert (ref != sampled).sum() > 100 and (ref == sampled).sum() > 100
    # Through the dispatcher and the state object too.
    state = TraceReplayState(num_slots, max_len, device="cuda")
    state.trace.copy_(trace)
    state.trace_len.copy_(trace_len)
    state._trace_len_writes.host[:] = trace_len.cpu().numpy()
    out2 = sampled.clone()
    state.apply(out2, slots, total_len, prompt_len, slots.cpu().numpy())
    assert torch.equal(out2, ref)
