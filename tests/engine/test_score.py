"""replayllm.score: values bit-equal to the engine's batch-invariant replay, gradients equal to the trainer
model's own teacher-forced log_softmax, weights synced after an optimizer step. CPU fp32 (bf16 engine: the RL
case of a bf16 sampler and an fp32 trainer). bench/gpu_check.sh re-runs it on CUDA (REPLAYLLM_TEST_DEVICE /
REPLAYLLM_TEST_DTYPE set the engine's device and dtype; the trainer model stays fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.hf_reference import VOCAB
from helpers.hf_reference import load_hf as _load_hf
from helpers.tolerances import LOGPROB_TOL
from helpers.trace_replay_common import DEVICE, DTYPE

from replayllm import LLM, SamplingParams, score


def _llm(path: str, **kw) -> LLM:
    opts = dict(batch_invariant=True, enable_trace_replay=True, device=DEVICE, dtype=DTYPE, max_model_len=128,
                skip_tokenizer_init=True)
    opts.update(kw)
    return LLM(path, **opts)


def _pairs(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))],
             [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]) for _ in range(n)]


def load_hf(path: str):
    return _load_hf(path).to(DEVICE)  # the trainer's model: fp32


def _replay(llm: LLM, pairs) -> list[list[float]]:
    """The engine's own numbers: each completion replayed as a trace after its prompt, one request at a time."""
    out = []
    for prompt, completion in pairs:
        params = SamplingParams(trace_decode_token_ids=completion, logprobs=0, trace_replay_chunk_size=1)
        res = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        out.append(list(res.outputs[0].logprobs.columns().logprobs))
    return out


def _teacher_forced(model, pairs) -> list[torch.Tensor]:
    """Plain HF teacher forcing, one sequence at a time (the gradient reference)."""
    out = []
    for prompt, completion in pairs:
        logits = model(torch.tensor([prompt + completion], device=DEVICE)).logits[0].float()
        lp = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].log_softmax(-1)
        out.append(lp.gather(1, torch.tensor(completion, device=DEVICE)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])  # qwen3: tied head; qwen2: biases, untied head
def test_values_are_the_replay_bits_and_gradients_the_models(tiny_models, name):
    llm = _llm(tiny_models[name])
    model = load_hf(tiny_models[name])
    pairs = _pairs(1, 6)
    got = score(llm, model, pairs)
    # Values: bit for bit what one-token-per-step replay reports, each request alone (another batch, another
    # schedule than score's single batched call with fast replay).
    assert [g.tolist() for g in got] == _replay(llm, pairs)
    assert all(g.shape == (len(c),) and g.dtype == torch.float32 for g, (_, c) in zip(got, pairs))
    # Gradients: those of the model's own teacher-forced log_softmax (score runs it batched: fp32 noise).
    sum(g.sum() for g in got).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(r.sum() for r in _teacher_forced(model, pairs)).backward()
    # Relative to each gradient's norm: batched vs one-at-a-time fp32 sums differ by ~1e-4 of an element on CUDA
    # (measured 6e-4 on entries of magnitude ~6 on the H200); a wrong gradient is off by O(1) of its norm.
    for n, p in model.named_parameters():
        err = (grads[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-12)
        assert err < 1e-3 or (grads[n] - p.grad).abs().max() < 1e-6, (n, float(err))
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_weights_follow_an_optimizer_step(tiny_models):
    llm = _llm(tiny_models["qwen3"])
    model = load_hf(tiny_models["qwen3"])
    pairs = _pairs(2, 3)
    before = score(llm, model, pairs)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    (-sum(b.sum() for b in before)).backward()
    opt.step()
    after = score(llm, model, pairs)
    # The engine now holds the updated weights: its replay (prompts whose KV was cached with the old weights
    # included: the prefix cache was dropped) gives score's new values, which moved with the step.
    assert [a.tolist() for a in after] == _replay(llm, pairs)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    if DTYPE == "float32":  # and they are the new weights' numbers (bf16 on these sharp tiny models: far off)
        with torch.no_grad():
            ref = _teacher_forced(model, pairs)
        # The engine vs transformers: another implementation, fp32 rounding (tolerances.LOGPROB_TOL).
        assert all(torch.allclose(a.detach(), r, atol=LOGPROB_TOL, rtol=0) for a, r in zip(after, ref))


def test_bf16_engine_fp32_trainer(tiny_models):
    """The RL case: the numbers of a bf16 sampler, the gradients of the fp32 trainer."""
    llm = _llm(tiny_models["qwen3"], dtype="bfloat16")
    model = load_hf(tiny_models["qwen3"])
    pairs = _pairs(3, 3)
    got = score(llm, model, pairs)
    assert [g.tolist() for g in got] == _replay(llm, pairs)
    sum(g.sum() for g in got).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_rejects_what_it_cannot_do(tiny_models):
    model = load_hf(tiny_models["qwen3"])
    plain = LLM(tiny_models["qwen3"], enable_trace_replay=True, device=DEVICE, skip_tokenizer_init=True,
                max_model_len=64)
    with pytest.raises(ValueError, match="batch_invariant=True"):
        score(plain, model, _pairs(4, 1))
    llm = _llm(tiny_models["qwen3"], max_model_len=64)
    with pytest.raises(ValueError, match="at least one token"):
        score(llm, model, [([5, 6], [])])
    with pytest.raises(ValueError, match="max_model_len"):
        score(llm, model, [([5] * 40, [6] * 30)])
    with pytest.raises(ValueError, match="pair"):
        score(llm, model, [[1, 2, 3]])
    for not_pairs in ([[5, 6]], [(5, 6)]):  # a flat id list / two ints: named, not a TypeError from list()
        with pytest.raises(ValueError, match=r"sequences\[0\] must be a .* pair of id lists"):
            score(llm, model, not_pairs)
    with pytest.raises(ValueError, match="sequences is empty"):
        score(llm, model, [])
