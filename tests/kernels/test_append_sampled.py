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
    append_sampled_torch(want_ids[:, :], want_len, slots[slots != 3], sampled[slots != 3])  # torch: full would fail
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
