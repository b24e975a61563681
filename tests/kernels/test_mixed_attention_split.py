"""REPLAYLLM_SPLIT_MIXED_ATTENTION (model_runner_v2/attention.py, opt-in): a mixed step's leading one-token rows
through the decode kernel, the rest through the prefill kernel, under the Triton interpreter; the compiled
kernels on CUDA: test_paged_attention.py's `mixed-split` case of test_kernels_vs_torch_on_cuda."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers.hf_reference import VOCAB
from test_paged_attention import SCALE, _assert_same, _attention_tol, _generate, paged_case

from replayllm import SamplingParams
from replayllm.model_runner_v2 import attention
from replayllm.model_runner_v2.attention import paged_attention_torch
from replayllm.model_runner_v2.forward_context import AttentionMetadata


def _with_host(md: AttentionMetadata) -> AttentionMetadata:
    """The host copies prepare_inputs gives a step (what the split decision reads)."""
    return dataclasses.replace(md, host_query_start_loc=md.query_start_loc.numpy(), host_seq_lens=md.seq_lens.numpy())


def test_leading_decode_rows():
    for q_lens, rows in (([1, 1, 1, 7, 1], 3), ([5, 1, 1], 0), ([1, 1], 2), ([2], 0)):
        _, _, md = paged_case(4, 2, 2, 16, q_lens, [8] * len(q_lens))
        assert attention.leading_decode_rows(_with_host(md)) == rows
        assert attention.leading_decode_rows(md) == 0  # no host copy: no device sync to find out


@pytest.mark.parametrize("split", [False, True])
def test_mixed_step_decode_rows_through_the_decode_kernel(monkeypatch, kernel_calls, split):
    """REPLAYLLM_SPLIT_MIXED_ATTENTION=1: a mixed step's leading one-token rows go to the decode kernel, the rest
    to the prefill kernel (rebased query_start_loc); off (the default): one prefill launch for all. Both within
    rounding of the torch backend."""
    monkeypatch.setattr(attention, "SPLIT_MIXED", split)
    monkeypatch.setattr(attention, "MIN_SPLIT_DECODE_ROWS", 3)
    q_lens, ctx = [1, 1, 1, 7, 20, 1, 3], [40, 9, 300, 0, 37, 60, 90]
    q, kv, md = paged_case(16, 4, 2, 32, q_lens, ctx)
    md = _with_host(md)
    out = attention.paged_attention_triton(q, kv, md, SCALE)
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(out, ref, atol=_attention_tol(ref, md), rtol=0)
    if split:
        assert [c.shape[0] for c in kernel_calls["decode"]] == [3]  # rows 0-2: one token each
        assert [c.shape[0] for c in kernel_calls["prefill"]] == [sum(q_lens) - 3]
        assert max(kernel_calls["splits"]) == 2  # the 301-key row split its context, as a decode step does
    else:
        assert kernel_calls["decode"] == [] and [c.shape[0] for c in kernel_calls["prefill"]] == [sum(q_lens)]
    # Fewer leading decode rows than MIN_SPLIT_DECODE_ROWS: one prefill launch either way.
    _, _, md2 = paged_case(16, 4, 2, 32, [1, 1, 5], [3, 4, 0])
    kernel_calls["prefill"].clear()
    attention.paged_attention_triton(q[:7], kv, _with_host(md2), SCALE)
    assert [c.shape[0] for c in kernel_calls["prefill"]] == [7]


def test_split_tail_is_made_once_a_step_and_aligned(monkeypatch):
    """The prefill part of a split step gets fresh tensors, made by the step's first layer and reused by the
    others: slices after an odd number of leading rows would start 8 bytes off 16-byte alignment, and Triton
    compiles another variant per pointer alignment (session 25 on the H200: the first split S1 run took 4.17 s
    against 2.18-2.20 s, compiling inside the run)."""
    monkeypatch.setattr(attention, "SPLIT_MIXED", True)
    monkeypatch.setattr(attention, "MIN_SPLIT_DECODE_ROWS", 3)
    seen = []
    inner = attention.paged_prefill_attention_triton
    monkeypatch.setattr(attention, "paged_prefill_attention_triton", lambda *a, **k: seen.append(a) or inner(*a, **k))
    q_lens, ctx = [1, 1, 1, 7, 20, 1, 3], [40, 9, 300, 0, 37, 60, 90]
    q, kv, md = paged_case(16, 4, 2, 32, q_lens, ctx)
    md = _with_host(md)
    first = attention.paged_attention_triton(q, kv, md, SCALE)
    second = attention.paged_attention_triton(q, kv, md, SCALE)  # the next layer of the same step
    assert torch.equal(first, second) and len(seen) == 2
    tail = md.split_tail
    assert tail.rows == 3 and tail.head_max_seq_len == 301
    for args in seen:
        qsl, seq_lens, tables = args[2:5]
        assert qsl is tail.query_start_loc and seq_lens is tail.seq_lens and tables is tail.block_tables
    assert tail.query_start_loc.tolist() == [0, 7, 27, 28, 31]
    assert torch.equal(tail.seq_lens, md.seq_lens[3:]) and torch.equal(tail.block_tables, md.block_tables[3:])
    assert md.seq_lens[3:].data_ptr() % 16 == 8  # what a slice would have passed
    for t in (tail.query_start_loc, tail.seq_lens, tail.block_tables):
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()


def test_split_mixed_steps_end_to_end(tiny_models, monkeypatch):
    """The engine with REPLAYLLM_SPLIT_MIXED_ATTENTION on: its mixed steps split (decode rows run first), tokens
    and logprobs as the torch backend's."""
    monkeypatch.setattr(attention, "SPLIT_MIXED", True)
    monkeypatch.setattr(attention, "MIN_SPLIT_DECODE_ROWS", 2)
    splits = []
    inner = attention._split_mixed
    monkeypatch.setattr(attention, "_split_mixed", lambda *a: splits.append(a[4]) or inner(*a))  # a[4]: rows
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 4, 6, 30, 45, 60)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    runs = {backend: _generate(tiny_models["qwen3"], backend, prompts, params, max_num_batched_tokens=24)[1]
            for backend in ("torch", "triton")}
    assert splits and min(splits) >= 2  # some mixed steps ran their leading decode rows apart
    _assert_same(runs["torch"], runs["triton"])
