"""kernels/append_sampled.py: the sampled tokens appended to the slots' token buffers in one launch, against the
torch reference (interpreter on CPU; compiled on CUDA in bench/gpu_check.sh's GPU_TESTS list)."""

from __future__ import annotations

import pytest
import torch

from replayllm.kernels.append_sampled import append_sampled_torch, append_sampled_triton
from replayllm.kernels.dispatch import triton_can_run


def _case(device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, 1000, (6, 10), generator=g, dtype=torch.int32)
    total_len = torch.tensor([3, 9, 0, 10, 5, 1], dtype=torch.int32)  # slot 3's buffer is full
    slots = torch.tensor([4, 0, 3, 1], dtype=torch.int64)  # distinct, any order; slots 2 and 5 not sampled
    sampled = torch.randint(0, 150_000, (4,), generator=g, dtype=torch.int64)
    return [t.to(device) for t in (token_ids, total_len, slots, sampled)]


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_the_reference(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not triton_can_run(torch.device(device)):
        pytest.skip("needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)")
    want_ids, want_len, slots, sampled = _case(device, seed)
    got_ids, got_len = want_ids.clone(), want_len.clone()
    before = want_ids[3].clone()
    append_sampled_torch(want_ids, want_len, slots[slots != 3], sampled[slots != 3])  # torch: a full row would fail
    append_sampled_triton(got_ids, got_len, slots, sampled)
    assert torch.equal(got_ids[slots[slots != 3]], want_ids[slots[slots != 3]])
    assert torch.equal(got_ids[3], before)  # a full buffer keeps its tokens
    assert got_len.tolist() == [4, 10, 0, 11, 6, 1]  # every sampled slot grew by one, the others did not
    assert want_len[slots[slots != 3]].tolist() == got_len[slots[slots != 3]].tolist()
    assert got_ids[4, 5].item() == sampled[0].to(torch.int32).item()  # slot 4 had 5 tokens: the 6th is the sample
    untouched = torch.tensor([2, 5])
    assert torch.equal(got_ids[untouched], _case(device, seed)[0][untouched])


def test_bad_inputs():
    ids, length, slots, sampled = _case("cpu", 0)
    for fn in (append_sampled_torch, append_sampled_triton):
        with pytest.raises(ValueError, match="token_ids must be int32"):
            fn(ids.long(), length, slots, sampled)
        with pytest.raises(ValueError, match="total_len must be int32"):
            fn(ids, length.long(), slots, sampled)
        with pytest.raises(ValueError, match="slots must be int64"):
            fn(ids, length, slots.int(), sampled)


def test_request_states_use_the_kernel_when_enabled(monkeypatch):
    """RequestStates.append_sampled_device takes the kernel where the fused kernels run and the switch is on
    (interpreter on CPU here), the torch path otherwise; both leave the same buffers."""
    if not triton_can_run(torch.device("cpu")):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    from replayllm.kernels import append_sampled, dispatch
    from replayllm.model_runner_v2.request_states import RequestStates

    calls = []
    kernel = append_sampled.append_sampled_triton
    monkeypatch.setattr(append_sampled, "append_sampled_triton", lambda *a: calls.append(1) or kernel(*a))
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(append_sampled, "ENABLED", enabled)
        monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
        states = RequestStates(max_num_reqs=3, max_model_len=8, max_blocks_per_seq=2, device=torch.device("cpu"))
        for i in range(3):
            states.add_request(f"r{i}", [5] * (i + 1), i + 1, [i])
        states.apply_staged_writes()
        states.append_sampled_device(torch.tensor([2, 0]), torch.tensor([77, 88]))
        results.append((states.token_ids.clone(), states.total_len.tensor.clone()))
        assert len(calls) == int(enabled)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[1][1].tolist() == [2, 2, 4] and results[1][0][2, 3].item() == 77


def test_the_kernel_is_the_default():
    """On by default (session 19 measured it on the H200: compiled test green, W4 faster); REPLAYLLM_APPEND_KERNEL=0
    is the A/B switch back to the torch ops."""
    import os

    from replayllm.kernels import append_sampled

    assert append_sampled.ENABLED is (os.environ.get("REPLAYLLM_APPEND_KERNEL", "1") != "0")
