"""The torch attention backend's memory is bounded by the step's tokens and the KV it reads (issue 31): the plan of
padded SDPA calls (model_runner_v2/attention_plan.py), split calls against one call, the batch-invariant path's
token chunks (bitwise), and an engine step mixing 64 decodes with a 2,000-token prompt under an RSS bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tolerances import LOGPROB_TOL, rounding_tol
from test_paged_attention import SCALE, paged_case

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.attention import (
    TORCH_ATTENTION_WORKSPACE_BYTES,
    invariant_attention_torch,
    paged_attention_torch,
)
from replayllm.model_runner_v2.attention_plan import PartCost, plan_attention

COST = PartCost.for_heads(num_heads=4, num_kv_heads=2, head_dim=16, elem_size=4)


def test_plan_covers_every_query_once_within_budget():
    rng = np.random.default_rng(0)
    for trial in range(100):
        rows = int(rng.integers(1, 40))
        q_lens = np.where(rng.random(rows) < 0.7, 1, rng.integers(1, 300, rows)).astype(np.int64)
        seq_lens = q_lens + rng.integers(0, 300, rows)
        budget = int(rng.choice([10**4, 10**5, 10**6, 10**12]))
        parts = plan_attention(q_lens, seq_lens, COST, budget)
        whole = COST.bytes(rows, int(q_lens.max()), int(seq_lens.max()))
        if whole <= budget:  # the whole step in one call, as the backend always did
            assert len(parts) == 1 and parts[0].rows is None
            continue
        covered = [np.zeros(n, dtype=np.int64) for n in q_lens]
        for p in parts:
            g = len(p.rows)
            assert p.max_query_len == p.q_count.max()
            for r, b, n in zip(p.rows, p.q_begin, p.q_count):
                covered[r][b : b + n] += 1
                assert seq_lens[r] - q_lens[r] + b + n <= p.max_seq_len  # the part's K reaches its latest query
            if g > 1 or p.max_query_len > 1:  # anything above the least call (one query of one row) fits
                assert COST.bytes(g, p.max_query_len, p.max_seq_len) <= budget, (trial, p)
        assert all((c == 1).all() for c in covered), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_calls_match_one_call(dtype):
    # A long prompt, decodes and a chunk over cached context: budgets that group rows and cut the long row into
    # query chunks. Same math, other padding: equal up to rounding.
    q, kv, md = paged_case(16, 6, 2, 16, [300, 1, 1, 40, 1], [0, 200, 20, 10, 500], dtype=dtype)
    one = paged_attention_torch(q, kv, md, SCALE, workspace_bytes=1 << 40)
    q_lens, seq_lens = md.query_start_loc.diff().numpy(), md.seq_lens.numpy()
    cost = PartCost.for_heads(6, 2, 16, kv.element_size())
    # fp32: two orders of the same sums. bf16: the probabilities rounded to bf16 before P @ V (each off by at most
    # eps/2 of itself: eps/2 * max|V| in all) and each side's output rounded once (eps/2 of max|out|).
    if dtype == torch.float32:
        tol = _attention_tol(one, md)
    else:
        tol = torch.finfo(dtype).eps * (kv[1].abs().max().item() + one.abs().max().item())
    for budget in (2_000_000, 200_000):
        assert len(plan_attention(q_lens, seq_lens, cost, budget)) > 1
        split = paged_attention_torch(q, kv, md, SCALE, workspace_bytes=budget)
        torch.testing.assert_close(split.float(), one.float(), atol=tol, rtol=0)


def test_eager_calls_are_planned_for_every_heads_scores(monkeypatch):
    """Soft caps and sinks run transformers' eager attention, which holds [rows, q heads, Q, K] scores (SDPA does
    not): the plan is costed for them, so a budget cuts more calls; the cut calls give one call's result."""
    from replayllm.model_runner_v2 import attention

    q, kv, md = paged_case(16, 6, 2, 16, [300, 1, 1, 40, 1], [0, 200, 20, 10, 500])
    sinks = torch.linspace(-2.0, 3.0, 6)
    costs = []
    monkeypatch.setattr(attention, "plan_attention", lambda *a: costs.append(a[2]) or plan_attention(*a))
    one = paged_attention_torch(q, kv, md, SCALE, sinks=sinks, workspace_bytes=1 << 40)
    sdpa, eager = PartCost.for_heads(6, 2, 16, 4), costs[-1]
    assert eager.per_qk >= 6 * sdpa.per_qk and eager.per_k > sdpa.per_k
    paged_attention_torch(q, kv, md, SCALE, softcap=2.0, workspace_bytes=1 << 40)
    assert costs[-1] == eager
    q_lens, seq_lens = md.query_start_loc.diff().numpy(), md.seq_lens.numpy()
    budget = 2_000_000
    assert len(plan_attention(q_lens, seq_lens, eager, budget)) > len(plan_attention(q_lens, seq_lens, sdpa, budget))
    split = paged_attention_torch(q, kv, md, SCALE, sinks=sinks, workspace_bytes=budget)
    torch.testing.assert_close(split, one, atol=_attention_tol(one, md), rtol=0)


def _attention_tol(ref: torch.Tensor, md) -> float:
    return rounding_tol(ref, terms=md.max_seq_len, steps=2)


def test_invariant_token_chunks_are_bitwise():
    # Batch-invariant mode on CPU: token chunks, each walking tiles up to its own furthest position, give the
    # bits of one call over the whole step.
    q, kv, md = paged_case(16, 6, 2, 16, [100, 1, 1, 20, 1], [0, 60, 20, 10, 150])
    one = invariant_attention_torch(q, kv, md, SCALE, workspace_bytes=1 << 40)
    for budget in (2_000_000, 500_000):  # ~52 KB per token here: chunks of 38 and 9 tokens
        assert torch.equal(invariant_attention_torch(q, kv, md, SCALE, workspace_bytes=budget), one)


def _status() -> dict[str, int]:
    """VmHWM (peak resident set since the last reset) and VmRSS of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS through /proc/self/clear_refs: {e}")


def test_long_prompt_among_decodes_stays_within_memory_bound():
    # 64 decoding rows + one 2,000-token prompt in one step. Padded to [rows, longest query, longest context] the
    # step's mask alone was 65 x 2000 x 2000 x (1 + 4) bytes = 1.3 GB (measured: 1,278 MiB of RSS growth, 23 s;
    # with a 4,000-token prompt 5.1 GB, 76 s); planned, the prompt gets its own call (2000 x 2000: ~20 MB) and
    # the decodes theirs (measured: 38 MiB). The bound: the attention budget (256 MiB) and as much again for the
    # rest of the step (logits of 65 rows x 151,936 ids, activations).
    bound = 2 * TORCH_ATTENTION_WORKSPACE_BYTES
    llm = LLM(device="cpu", dtype="float32", max_model_len=2048, seed=0)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 5000, 2000).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    alone = llm.generate({"prompt_token_ids": long_prompt}, greedy, use_tqdm=False)[0].outputs[0]
    decoding = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"d{i}", {"prompt_token_ids": rng.integers(100, 5000, 8).tolist()}, decoding)
    engine.step()  # their prompts: all 64 are decoding from the next step on
    engine.add_request("long", {"prompt_token_ids": long_prompt}, greedy)
    cost = PartCost.for_heads(4, 2, 16, 4)  # the embedded model's attention: 4 heads, 2 KV heads, head_dim 16
    assert cost.bytes(65, 2000, 2000) > 2 * bound  # what one padded call over the step would hold
    _reset_peak_rss()
    before = _status()["VmRSS"]
    outputs = engine.step()
    growth = _status()["VmHWM"] - before
    engine.abort_request([f"d{i}" for i in range(64)])
    mixed = {o.request_id: o for o in outputs}["long"]
    assert mixed.finished  # the whole prompt ran in this step, beside the 64 decodes
    assert len(outputs) == 65
    assert growth <= bound, f"peak RSS grew {growth / 2**20:.0f} MiB in one step (bound {bound / 2**20:.0f} MiB)"
    # The prompt's result does not depend on the decodes beside it (beyond rounding: other GEMM shapes).
    token = alone.token_ids[0]
    lp_mixed = mixed.outputs[0].logprobs[0]
    assert token in lp_mixed, (token, lp_mixed)
    assert abs(lp_mixed[token].logprob - alone.logprobs[0][token].logprob) <= LOGPROB_TOL
