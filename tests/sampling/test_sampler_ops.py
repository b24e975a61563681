"""Sampler steps against naive per-row references; Gumbel sampling against the softmax distribution."""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from helpers.tolerances import log_softmax_tol

from replayllm.sampling.gumbel import gumbel_noise
from replayllm.sampling.ops import (
    apply_allowed_token_ids,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)
from replayllm.sampling.sampling_states import SamplingStates
from replayllm.sampling_params import SamplingParams


def test_penalties_match_naive_reference():
    torch.manual_seed(0)
    R, V, L = 3, 20, 12
    logits = torch.randn(R, V)
    tokens = torch.randint(0, V, (R, L))
    prompt_len = torch.tensor([4, 2, 6])
    total_len = torch.tensor([9, 12, 6])
    rep = torch.tensor([1.5, 1.0, 2.0])
    freq = torch.tensor([0.3, -0.5, 0.0])
    pres = torch.tensor([0.2, 0.1, 1.0])
    ref = logits.clone()
    for r in range(R):
        seen = set(tokens[r, : total_len[r]].tolist())
        outs = tokens[r, prompt_len[r] : total_len[r]].tolist()
        for t in range(V):
            x = ref[r, t].item()
            if t in seen:
                x = x / rep[r].item() if x > 0 else x * rep[r].item()
            x -= freq[r].item() * outs.count(t) + pres[r].item() * (t in outs)
            ref[r, t] = x
    got = logits.clone()
    apply_penalties(got, tokens, prompt_len, total_len, rep, freq, pres)
    torch.testing.assert_close(got, ref)


def test_top_k_top_p_min_p_match_naive_reference():
    torch.manual_seed(1)
    R, V = 4, 30
    logits = torch.randn(R, V)
    k = torch.tensor([0, 3, 1, 10])
    p = torch.tensor([1.0, 0.9, 0.5, 0.3])
    got = logits.clone()
    apply_top_k_top_p(got, k, p)
    for r in range(R):
        row = logits[r].clone()
        order = row.argsort(descending=True)
        keep = set(order[: (k[r].item() or V)].tolist())
        probs = torch.where(torch.tensor([i in keep for i in range(V)]), row, -math.inf).softmax(-1)
        cum, kept = 0.0, set()
        for i in probs.argsort(descending=True).tolist():  # smallest prefix whose mass reaches top_p
            if i not in keep:
                break
            kept.add(i)
            cum += probs[i].item()
            if cum >= p[r].item() - 1e-6:
                break
        assert {i for i in range(V) if got[r, i] > -math.inf} == kept
    m = logits.clone()
    apply_min_p(m, torch.tensor([0.0, 0.5, 0.1, 1.0]))
    probs = logits.softmax(-1)
    for r, mp in enumerate([0.0, 0.5, 0.1, 1.0]):
        kept = probs[r] >= mp * probs[r].max()
        assert torch.equal(m[r] > -math.inf, kept)


def test_gumbel_noise_is_deterministic_and_samples_softmax():
    seeds = torch.tensor([7, 7, 8])
    pos = torch.tensor([3, 3, 3])
    g = gumbel_noise(seeds, pos, 50)
    assert torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2]) and torch.isfinite(g).all()
    # Frequencies of argmax(logits + noise) over many positions approach softmax(logits).
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 20000
    noise = gumbel_noise(torch.full((n,), 123), torch.arange(n), 4)
    freq = torch.bincount((logits + noise).argmax(-1), minlength=4).float() / n
    assert torch.allclose(freq, logits.softmax(-1), atol=0.015)  # ~4 sigma of a frequency over 20000 draws


def test_gumbel_noise_finite_over_a_full_vocabulary():
    # The top 24-bit hash used to round to u == 1.0 (+inf noise: that token won whatever its logit, and a masked
    # -inf logit became nan); over 151,936 tokens that hit ~1% of rows.
    g = gumbel_noise(torch.arange(64), torch.full((64,), 9), 151_936)
    assert torch.isfinite(g).all()


# ---- logit_bias / allowed_token_ids ------------------------------------------------------------------------

def test_logit_bias_matches_naive_reference():
    torch.manual_seed(2)
    R, V = 3, 20
    logits = torch.randn(R, V)
    logits[1, 7] = -math.inf  # an already-masked token stays masked whatever its bias
    ids = torch.tensor([[3, 7, 0, 19], [7, 3, 3, 3], [5, 5, 5, 5]], dtype=torch.int32)
    bias = torch.tensor([[1.5, -2.0, 100.0, 0.25], [4.0, 9.0, 9.0, 9.0], [8.0, 8.0, 8.0, 8.0]])
    count = torch.tensor([4, 1, 0], dtype=torch.int32)  # entries past the count are stale: ignored
    ref = logits.clone()
    for r in range(R):
        for j in range(int(count[r])):
            ref[r, ids[r, j]] += bias[r, j]
    got = logits.clone()
    apply_logit_bias(got, ids, bias, count)
    assert torch.equal(got, ref)  # exact: untouched entries get + 0.0
    assert got[1, 7] == -math.inf and torch.equal(got[2], logits[2])


def test_allowed_token_ids_matches_naive_reference():
    torch.manual_seed(3)
    R, V = 3, 16
    logits = torch.randn(R, V)
    ids = torch.tensor([[4, 9, 1], [2, 11, 12], [6, 6, 6]], dtype=torch.int32)
    count = torch.tensor([2, 3, 0], dtype=torch.int32)  # row 0's third id (1) is stale; row 2 uses no list
    got = logits.clone()
    apply_allowed_token_ids(got, ids, count)
    for r, allowed in enumerate([{4, 9}, {2, 11, 12}, set(range(V))]):
        for t in range(V):
            assert got[r, t] == (logits[r, t] if t in allowed else -math.inf)


def _bias_rows(st: SamplingStates, slots: list[int]) -> list[dict[int, float]]:
    """What the sampler would apply for these slots, read back from the device state."""
    lb = st.logit_bias
    out = []
    for s in slots:
        n = int(lb.num_bias.tensor[s])
        assert n == lb.num_bias.host[s]
        out.append(dict(zip(lb.bias_token_ids.tensor[s, :n].tolist(), lb.bias_values.tensor[s, :n].tolist())))
    return out


def test_logit_bias_state_staging_growth_and_slot_reuse():
    st = SamplingStates(4, torch.device("cpu"))
    big = {t: float(t % 7) - 3.0 for t in range(40)}  # longer than the initial row width: the rows grow
    st.add_request(0, SamplingParams(logit_bias={5: 2.0, 9: -1.0}, allowed_token_ids=[3, 3, 8]), 0, (), [])
    st.add_request(1, SamplingParams(), 0, (), [])
    st.apply_staged_writes()
    st.add_request(2, SamplingParams(logit_bias=big), 0, (), [])
    st.apply_staged_writes()
    assert _bias_rows(st, [0, 1, 2]) == [{5: 2.0, 9: -1.0}, {}, big]  # slot 0 survived the growth
    lb = st.logit_bias
    assert lb.num_allowed.host.tolist() == [2, 0, 0, 0]  # duplicates dropped
    assert lb.allowed_token_ids.tensor[0, :2].tolist() == [3, 8]
    # Slot 0 is reused by a request without bias or allowed ids: nothing of the previous owner applies.
    st.add_request(0, SamplingParams(), 0, (), [])
    st.apply_staged_writes()
    assert _bias_rows(st, [0]) == [{}] and lb.num_allowed.host[0] == 0 and int(lb.num_allowed.tensor[0]) == 0
    logits = torch.zeros(2, 50)
    slots = torch.tensor([0, 1])
    apply_logit_bias(logits, lb.bias_token_ids.tensor[slots], lb.bias_values.tensor[slots], lb.num_bias.tensor[slots])
    apply_allowed_token_ids(logits, lb.allowed_token_ids.tensor[slots], lb.num_allowed.tensor[slots])
    assert torch.equal(logits, torch.zeros(2, 50))
    assert not np.any(lb.num_bias.host[[0, 1]])  # the sampler's host check skips both steps for this batch


def test_extreme_valid_values_saturate_in_the_slot_dtypes():
    """temperature 1e300 or top_k 2**40 pass validation; staging them used to warn (float32 overflow to inf) or
    raise OverflowError (int32) inside the engine step. They saturate at the dtype's largest value instead."""
    st = SamplingStates(2, torch.device("cpu"))
    f32, i32 = np.finfo(np.float32).max, np.iinfo(np.int32).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.add_request(0, SamplingParams(temperature=1e300, top_k=2**40, repetition_penalty=1e300), 0, (), [])
        st.add_request(1, SamplingParams(temperature=0.5, top_k=7, repetition_penalty=1.5), 0, (), [])
        st.apply_staged_writes()
    assert st.temperature.tensor.tolist() == [f32, 0.5] and st.temperature.host.tolist() == [f32, 0.5]
    assert st.top_k.tensor.tolist() == [i32, 7] and st.repetition_penalty.tensor.tolist() == [f32, 1.5]
    logits = torch.randn(1, 30)
    kept = logits.clone()
    apply_top_k_top_p(kept, st.top_k.tensor[:1], None)  # past the vocab: nothing truncated
    assert torch.equal(kept, logits)


def test_sampler_reports_from_untouched_model_dtype_logits(tiny_models, monkeypatch):
    """The runner hands the sampler the LM head's logits in the model's dtype (bf16 here). Whatever the batch
    mixes (greedy, trace-free sampling, logit_bias, penalties), the sampler never edits that tensor, and every
    reported logprob is log_softmax of its exact fp32 upcast at the final token."""
    from replayllm import LLM
    from replayllm.sampling.sampler import Sampler

    llm = LLM(tiny_models["qwen3"], device="cpu", dtype="bfloat16", max_model_len=64, skip_tokenizer_init=True)
    checks = []
    real_call = Sampler.__call__

    def spy(self, logits, *args):
        before = logits.clone()
        out = real_call(self, logits, *args)
        ref = logits.float().log_softmax(-1).gather(1, out.sampled[:, None])[:, 0]
        err = (out.logprob - ref).abs().max().item()  # logit - logsumexp vs log_softmax: fp32 rounding
        checks.append((logits.dtype, torch.equal(before, logits), err <= log_softmax_tol(logits)))
        return out

    monkeypatch.setattr(Sampler, "__call__", spy)
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, logit_bias={7: 5.0}),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, repetition_penalty=1.3)]
    for subset in ([0], [0, 1], [0, 2], [3], [0, 1, 2, 3]):
        llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in subset], [params[i] for i in subset],
                     use_tqdm=False)
    assert checks and all(dtype == torch.bfloat16 and same and close for dtype, same, close in checks), checks


def test_logit_bias_comes_before_the_penalties_as_vllm(tiny_models, monkeypatch):
    """vLLM's samplers add logit_bias first, then apply the penalties: a biased token already seen has
    (logit + bias) / repetition_penalty (for a positive sum), not logit / repetition_penalty + bias. Each greedy
    step's token is the argmax of that order over the step's raw logits; the biases tried include ones where the
    other order picks another token (else this test could not tell them apart)."""
    from replayllm import LLM
    from replayllm.sampling.sampler import Sampler

    llm = LLM(tiny_models["qwen3"], device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    steps = []
    real_call = Sampler.__call__

    def spy(self, logits, *args):
        raw = logits[0].clone()  # before the call: an fp32 batch's logits are edited in place
        out = real_call(self, logits, *args)
        steps.append((raw, int(out.sampled[0])))
        return out

    monkeypatch.setattr(Sampler, "__call__", spy)
    prompt, rp, token = [5, 6, 7, 8], 1.5, 7
    orders_differ = False
    for bias in (1.0, 2.0, 4.0, 8.0, 16.0):
        steps.clear()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                   repetition_penalty=rp, logit_bias={token: bias}),
                     use_tqdm=False)
        seen = list(prompt)
        for raw, sampled in steps:
            ids = torch.tensor(sorted(set(seen)))

            def penalised(x, ids=ids):
                x = x.clone()
                x[ids] = torch.where(x[ids] > 0, x[ids] / rp, x[ids] * rp)
                return x

            biased = raw.clone()
            biased[token] += bias
            vllm_order = penalised(biased)
            other_order = penalised(raw)
            other_order[token] += bias
            assert sampled == int(vllm_order.argmax()), (bias, seen)
            orders_differ |= int(other_order.argmax()) != sampled
            seen.append(sampled)
    assert orders_differ
