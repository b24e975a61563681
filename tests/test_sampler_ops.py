"""Sampler steps against naive per-row references; Gumbel sampling against the softmax distribution."""

from __future__ import annotations

import math

import torch

from replayllm.sampling.gumbel import gumbel_noise
from replayllm.sampling.ops import apply_min_p, apply_penalties, apply_top_k_top_p


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
    assert torch.allclose(freq, logits.softmax(-1), atol=0.015)
