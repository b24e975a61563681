"""Speculative decoding below the engine: config validation, the n-gram proposer, and the sampler's verification
(exact rejection sampling for a point-mass draft), checked against plain torch on a vocabulary of 8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replayllm.config import EngineConfig
from replayllm.engine.ngram_proposer import NgramProposer
from replayllm.sampling.sampler import MultiPositionRows, Sampler, SlotTokens, verify_drafts
from replayllm.sampling_params import SamplingParams
from replayllm.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min \\(4\\) must be <="),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min must be an int >= 1"),
    ({**NGRAM, "lookahead": 2}, "unknown keys \\['lookahead'\\]"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_configs_are_value_errors(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(device="cpu", speculative_config=value)


def test_speculative_config_defaults_and_engine_rules():
    assert SpeculativeConfig.from_value(NGRAM) == SpeculativeConfig("ngram", 3, 5, 5)  # vLLM: neither -> 5, 5
    assert SpeculativeConfig.from_value({**NGRAM, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.from_value({**NGRAM, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    with pytest.raises(ValueError, match="async_scheduling=True is not supported with speculative"):
        EngineConfig(device="cpu", speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config.*incompatible with trace replay"):
        EngineConfig(device="cpu", speculative_config=NGRAM, enable_trace_replay=True)
    with pytest.raises(ValueError, match="trace_decode_token_ids cannot be used while speculative decoding"):
        SamplingParams(trace_decode_token_ids=[5, 6]).verify_for_engine(
            prompt_len=3, max_model_len=64, vocab_size=100, max_logprobs=5, enable_trace_replay=False,
            speculative=True)


def test_ngram_proposer_longest_then_earliest_match():
    p = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    # suffix [7, 8, 9] occurred at 1: the 3 tokens after it
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 10) == [4, 5, 6]
    assert p.propose([1, 7, 8, 9, 4, 5, 6, 2, 7, 8, 9], 2) == [4, 5]  # capped by the caller's limit
    # only the 1-gram [9] matches; its earliest occurrence wins (vLLM's choice), drafts stop at the end
    assert p.propose([9, 3, 9, 4, 9], 10) == [3, 9, 4]
    assert p.propose([1, 2, 3, 4], 10) == []  # no earlier occurrence of any suffix
    assert p.propose([5, 5], 10) == [5]  # the match may overlap the suffix, not be it
    assert p.propose([5], 10) == [] and p.propose([1, 1, 1], 0) == []
    longer = NgramProposer(SpeculativeConfig("ngram", 2, prompt_lookup_min=2, prompt_lookup_max=2))
    assert longer.propose([9, 3, 9, 4, 9], 10) == []  # no 2-gram repeats: min 2 forbids the 1-gram match


def _sampler(num_slots: int, params: SamplingParams, seeds: list[int]) -> tuple[Sampler, SlotTokens]:
    sampler = Sampler(num_slots, 16, torch.device("cpu"), enable_trace_replay=False)
    for slot, seed in enumerate(seeds):
        sampler.add_request(slot, params, seed, (), [])
    sampler.apply_staged_writes()
    token_ids = torch.zeros(num_slots, 16, dtype=torch.int32)
    lens = torch.full((num_slots,), 4, dtype=torch.int32)  # every slot samples position 4 (then 5)
    tokens = SlotTokens(token_ids, token_ids.numpy(), lens.clone(), lens, lens.numpy().copy(), lens.numpy())
    return sampler, tokens


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token outside the support was sampled"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_verification_keeps_the_sampling_distribution():
    """N rows, one per seed, each [last, x] with logits l0, l1 at its two positions and draft x: the emitted first
    token is distributed as p0 (temperature 0.7, top_k 6: plain torch below), x is accepted with probability
    p0(x), and after an accepted x the next token follows p1; a rejected row keeps exactly its first token.
    Chi-square with 5 degrees of freedom: 40 is far beyond the 1e-6 tail (~36)."""
    n, vocab, draft = 6000, 8, 3
    gen = torch.Generator().manual_seed(0)
    l0, l1 = torch.randn(vocab, generator=gen) * 1.5, torch.randn(vocab, generator=gen) * 1.5
    l0[draft] = l0.max() - 0.3  # a likely but not certain draft
    params = SamplingParams(temperature=0.7, top_k=6)

    def reference(logits):  # plain torch: softmax(l / T) over the top 6, renormalised
        p = torch.softmax(logits / 0.7, -1)
        p[torch.argsort(logits, descending=True)[6:]] = 0
        return (p / p.sum()).numpy().astype(np.float64)

    p0, p1 = reference(l0), reference(l1)
    sampler, tokens = _sampler(n, params, seeds=list(range(1000, 1000 + n)))
    slots = torch.arange(n).repeat_interleave(2)  # [2N], a row's positions adjacent
    logits = torch.stack([l0, l1]).repeat(n, 1)  # [2N, V]
    offsets = torch.tensor([0, 1]).repeat(n)
    last = torch.arange(1, 2 * n, 2)
    multi_position = MultiPositionRows(np.full(n, 2), offsets, offsets.numpy(), last, last.numpy(),
                          draft_token_ids=torch.tensor([draft, -1]).repeat(n))
    out = sampler(logits, slots, slots.numpy(), tokens, multi_position)
    sampled = out.sampled.view(n, 2).numpy()
    kept = out.accepted.view(n, 2).numpy()
    assert kept[:, 0].all() and (kept[:, 1] == (sampled[:, 0] == draft)).all()
    assert (out.num_accepted.numpy() == kept.sum(1)).all()

    first = np.bincount(sampled[:, 0], minlength=vocab)
    assert _chi2(first, p0) < 40
    untempered = torch.softmax(l0, -1).numpy().astype(np.float64)  # no temperature, no top-k: a wrong p
    assert _chi2(first, untempered) > 200  # the statistic tells distributions apart at this N
    accepted = sampled[:, 0] == draft
    assert abs(accepted.mean() - p0[draft]) < 5 * np.sqrt(p0[draft] * (1 - p0[draft]) / n)
    assert _chi2(np.bincount(sampled[accepted, 1], minlength=vocab), p1) < 40

    # The same seeds without drafts (plain decoding of position 4) draw the very same first tokens.
    plain_sampler, plain_tokens = _sampler(n, params, seeds=list(range(1000, 1000 + n)))
    plain = plain_sampler(l0.repeat(n, 1), torch.arange(n), np.arange(n), plain_tokens)
    assert (plain.sampled.numpy() == sampled[:, 0]).all()


def test_verify_drafts_keeps_the_accepted_prefix_per_row():
    # rows: 3 positions (drafts 5, 6), 1 position, 3 positions (drafts 7, 7)
    sampled = torch.tensor([5, 9, 1, 4, 7, 8, 2])
    checks = torch.tensor([5, 6, -1, -1, 7, 7, -1])
    offsets = torch.tensor([0, 1, 2, 0, 0, 1, 2])
    last = torch.tensor([2, 3, 6])
    multi_position = MultiPositionRows(np.array([3, 1, 3]), offsets, offsets.numpy(), last, last.numpy(), checks)
    kept, num_kept = verify_drafts(sampled, multi_position)
    assert kept.tolist() == [True, True, False, True, True, True, False]
    assert num_kept.tolist() == [2, 1, 2]
