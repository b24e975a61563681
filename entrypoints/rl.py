"""The RL loop (issue 29; docs/rl.md, "The loop: a runnable GRPO example"): sample rollouts with the engine, score
them with the trainer, take one GRPO step, hand the new weights back to the engine, and measure how far the
trainer's logprobs of the sampled tokens are from the sampler's (`mismatch_stats`). `save_rollouts` writes the
rollouts as a trace file whose logprobs are the sampler's, which `replayllm diff --a file` reads as a side.

Users import it as `replayllm.rl` (the root-level rl.py re-exports it); `replayllm rl-demo`
(entrypoints/cli/rl_demo.py) runs it."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..sampling_params import RequestOutputKind, SamplingParams
from .diff.resolved import engine_resolved, versions
from .diff.trace_file import TraceRecord, write_traces
from .score import reference_logprobs, score

if TYPE_CHECKING:
    from .llm import LLM

Logprobs = Sequence[float] | torch.Tensor  # one rollout's per-token logprobs, [len(completion)]
Reward = Callable[[list[int], list[int]], float]  # (prompt ids, completion ids) -> the rollout's reward
ADVANTAGE_EPS = 1e-6  # (r - mean) / (std + eps): a group whose rewards are all equal gets advantage 0, not nan


@dataclass(frozen=True)
class MismatchStats:
    """Trainer vs sampler over every token of a step; per token Δ = trainer logprob − sampler logprob of the
    token the sampler emitted."""

    num_tokens: int
    mean_abs: float  # mean |Δ|
    max_abs: float  # max |Δ|
    # k3 estimator of KL(sampler ‖ trainer): the mean of exp(Δ) − 1 − Δ (>= 0 per token). Unbiased on tokens drawn
    # from the sampler's reported distribution (temperature 1, no top-k/top-p: the engine reports raw logprobs).
    kl: float
    share_above: float  # fraction of tokens with |Δ| > threshold
    threshold: float


def mismatch_stats(sampler_logprobs: Sequence[Logprobs], trainer_logprobs: Sequence[Logprobs],
                   threshold: float = 0.1) -> MismatchStats:
    """Per-token comparison of the sampler's and the trainer's logprobs of the same sampled tokens.

    sampler_logprobs, trainer_logprobs: one 1-D sequence (list or tensor, any device) per rollout, rollout i of
    the same length on both sides; computed in float64. Δ = trainer − sampler. The KL is the k3 estimator
    (Schulman, "Approximating KL divergence"): with r = Δ = log q(x) − log p(x), p the sampler and q the trainer,
    E_{x~p}[exp(r) − 1 − r] = E_p[q/p] − 1 + KL(p ‖ q) = KL(p ‖ q), so its mean over tokens sampled from p is an
    unbiased, never negative estimate of KL(sampler ‖ trainer) per token. Raises ValueError naming the rollout
    for a length or shape mismatch, a NaN, or when there is no token at all."""
    if len(sampler_logprobs) != len(trainer_logprobs):
        raise ValueError(f"mismatch_stats: {len(sampler_logprobs)} sampler rollouts but {len(trainer_logprobs)} "
                         "trainer rollouts")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"mismatch_stats: threshold must be a finite number >= 0, got {threshold!r}")
    deltas = []
    for i, (s, t) in enumerate(zip(sampler_logprobs, trainer_logprobs)):
        s64, t64 = _float64(s, i, "sampler"), _float64(t, i, "trainer")
        if s64.shape != t64.shape:
            raise ValueError(f"mismatch_stats: rollout {i} has {s64.numel()} sampler logprobs but {t64.numel()} "
                             "trainer logprobs")
        deltas.append(t64 - s64)
    delta = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)  # [tokens of every rollout]
    if delta.numel() == 0:
        raise ValueError("mismatch_stats: no tokens to compare")
    abs_delta = delta.abs()
    kl = torch.expm1(delta) - delta  # exp(Δ) − 1 − Δ, with expm1 for the Δ ≈ 0 tokens (exactly 0 at Δ = 0)
    return MismatchStats(num_tokens=delta.numel(), mean_abs=float(abs_delta.mean()), max_abs=float(abs_delta.max()),
                         kl=float(kl.mean()), share_above=float((abs_delta > threshold).double().mean()),
                         threshold=float(threshold))


def _float64(values: Logprobs, i: int, side: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        t = values.detach().to("cpu", torch.float64)
    else:
        t = torch.as_tensor(list(values), dtype=torch.float64)
    if t.dim() != 1:
        raise ValueError(f"mismatch_stats: rollout {i}'s {side} logprobs must be 1-D, got shape {tuple(t.shape)}")
    if bool(t.isnan().any()):
        raise ValueError(f"mismatch_stats: rollout {i}'s {side} logprobs hold a NaN")
    return t


@dataclass(frozen=True)
class Rollout:
    """One sampled completion with what the sampler reported for it."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    sampler_logprobs: list[float]  # [len(completion)] the engine's logprob of each emitted token (raw logits)
    reward: float
    group: int  # index of its prompt in the step: advantages are normalised within a group
    index: int  # which of the group's n samples


@dataclass(frozen=True)
class StepRecord:
    """What one grpo_step did."""

    step: int
    mean_reward: float
    loss: float
    mismatch: MismatchStats  # trainer vs sampler on this step's rollouts, before the optimizer step
    rollouts: list[Rollout]  # [prompts × n], prompt-major
    seconds: float  # wall time of the whole step (sampling, scoring, backward, optimizer, weight sync)


def grpo_step(llm: LLM, trainer: nn.Module, optimizer: torch.optim.Optimizer, prompts: Sequence[Sequence[int]],
              reward: Reward, *, n: int = 4, temperature: float = 1.0, max_tokens: int = 16, step: int = 0,
              threshold: float = 0.1) -> StepRecord:
    """One GRPO step with the engine as the sampler and `trainer` (a transformers causal LM, HF parameter names)
    as the policy being trained. The engine must hold the trainer's weights when called (`llm.load_weights(
    trainer)` once before the first step; every step ends with that copy).

    1. Sample n completions per prompt (token id lists), each token's logprob reported (`logprobs=0`).
    2. The trainer's teacher-forced logprob of every sampled token: `replayllm.score` when the engine runs
       batch-invariant (values = the engine's own bits, so the mismatch is exactly 0; gradients the trainer's),
       else transformers' log_softmax in one right-padded batch.
    3. Loss: advantages normalised per prompt, A = (r − mean) / (std + 1e-6) (sample std over the group's n
       rewards); per token the importance ratio exp(trainer_lp − sampler_lp) (the sampler side a constant);
       loss = −mean over every token of ratio × A. Backward, optimizer step, zero_grad.
    4. `llm.load_weights(trainer)`: the engine samples the next step from the new weights.
    Temperature: the engine reports logprobs of the raw logits; at temperature 1 they are the sampling
    distribution's, so the ratio and the KL estimate are exact; at another temperature both are biased."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"grpo_step: n must be an integer >= 2 (GRPO normalises rewards within a group), got {n!r}")
    start = time.perf_counter()
    rollouts = sample_rollouts(llm, prompts, reward, n=n, temperature=temperature, max_tokens=max_tokens)
    trainer_lps = trainer_logprobs(llm, trainer, rollouts)  # [len(completion)] float32 each, with autograd
    stats = mismatch_stats([r.sampler_logprobs for r in rollouts], trainer_lps, threshold)
    loss = grpo_loss(trainer_lps, [r.sampler_logprobs for r in rollouts],
                     group_advantages([r.reward for r in rollouts], n))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    llm.load_weights(trainer)
    return StepRecord(step=step, mean_reward=sum(r.reward for r in rollouts) / len(rollouts), loss=float(loss.detach()),
                      mismatch=stats, rollouts=rollouts, seconds=time.perf_counter() - start)


def sample_rollouts(llm: LLM, prompts: Sequence[Sequence[int]], reward: Reward, *, n: int, temperature: float,
                    max_tokens: int) -> list[Rollout]:
    """n completions of every prompt in one `generate` call, with rewards: [len(prompts) × n], prompt-major."""
    prompts = [list(p) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("grpo_step: prompts must be a non-empty list of non-empty token id lists")
    params = SamplingParams(n=n, temperature=temperature, logprobs=0, max_tokens=max_tokens, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rollouts = []
    for group, (prompt, out) in enumerate(zip(prompts, outputs)):
        for comp in sorted(out.outputs, key=lambda c: c.index):
            completion = list(comp.token_ids)
            if not completion:
                raise ValueError(f"grpo_step: prompt {group} ({len(prompt)} tokens) left no room for a completion "
                                 "(max_model_len)")
            # The sampled token's entry of each position's {token id: Logprob}.
            logprobs = [d[token].logprob for token, d in zip(completion, comp.logprobs)]
            value = float(reward(prompt, completion))
            if not math.isfinite(value):  # refused before any backward: a NaN loss would poison trainer and engine
                raise ValueError(f"grpo_step: the reward of prompt {group}'s completion {comp.index} is {value}; "
                                 "rewards must be finite numbers")
            rollouts.append(Rollout(prompt, completion, logprobs, value, group, comp.index))
    return rollouts


def trainer_logprobs(llm: LLM, trainer: nn.Module, rollouts: Sequence[Rollout]) -> list[torch.Tensor]:
    """The trainer's teacher-forced logprob of every sampled token, [len(completion)] float32 per rollout on the
    trainer's device, differentiable in the trainer's parameters. Batch-invariant engine: `score` (values the
    engine's replay bits, which equal its sampling-time ones; the weights are already in sync). Otherwise plain
    transformers: log_softmax of trainer(input_ids).logits at the completion's positions."""
    pairs = [(r.prompt_token_ids, r.completion_token_ids) for r in rollouts]
    if llm.llm_engine.config.batch_invariant:
        return score(llm, trainer, pairs, sync_weights=False)
    return reference_logprobs(trainer, pairs, next(trainer.parameters()).device)


def group_advantages(rewards: Sequence[float], n: int) -> torch.Tensor:
    """GRPO's advantages: rewards [groups × n] (prompt-major), each normalised within its group by
    (r − mean) / (std + ADVANTAGE_EPS), std the sample standard deviation (n − 1). Returns [groups × n] float64."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    if r.numel() % n:
        raise ValueError(f"group_advantages: {r.numel()} rewards are not groups of n={n}")
    groups = r.view(-1, n)  # [groups, n]
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + ADVANTAGE_EPS)
    return adv.view(-1)


def grpo_loss(trainer_lps: Sequence[torch.Tensor], sampler_lps: Sequence[Sequence[float]],
              advantages: torch.Tensor) -> torch.Tensor:
    """−mean over every token of exp(trainer_lp − sampler_lp) × A(rollout). trainer_lps: [len] tensors with
    autograd; sampler_lps: the engine's numbers (constants: no gradient flows to the sampler); advantages: [rollouts].
    On-policy (one optimizer step per batch of rollouts) the ratio is ~1 and its gradient ratio × ∇trainer_lp is
    the policy gradient; the ratio corrects for the sampler ≠ trainer numerics. No clipping (one step per batch)."""
    lp = torch.cat(list(trainer_lps))  # [tokens]
    old = torch.tensor([x for lps in sampler_lps for x in lps], dtype=lp.dtype, device=lp.device)  # [tokens]
    lengths = torch.tensor([len(lps) for lps in sampler_lps], device=lp.device)
    adv = advantages.to(lp.device, lp.dtype).repeat_interleave(lengths)  # [tokens]: each rollout's A on its tokens
    return -(torch.exp(lp - old) * adv).mean()


def save_rollouts(path: str | os.PathLike, records: Sequence[StepRecord], llm: LLM | None = None) -> int:
    """Write every rollout of `records` as a trace file (docs/diff.md, "Trace file format"): the prompt ids, the
    completion as the trace and the sampler's logprobs as `logprobs`, so `replayllm diff --traces PATH --a file
    --b SPEC` compares the sampler's numbers with a replay. Ids "s{step}-p{prompt}-{sample}"; meta holds step,
    prompt, sample and reward. The header's provenance names the tool and, given `llm`, the engine's resolved
    config. Rollouts of step k came from the weights after k optimizer steps. Returns the number written."""
    rows = [TraceRecord(id=f"s{rec.step}-p{r.group}-{r.index}", trace_token_ids=r.completion_token_ids,
                        prompt_token_ids=r.prompt_token_ids, logprobs=r.sampler_logprobs,
                        meta={"step": rec.step, "prompt": r.group, "sample": r.index, "reward": r.reward})
            for rec in records for r in rec.rollouts]
    if not rows:
        raise ValueError("save_rollouts: the records hold no rollouts")
    provenance: dict[str, Any] = {"tool": "replayllm rl", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "versions": versions(), "steps": [rec.step for rec in records],
                                  "weights": "the rollouts of step k were sampled after k optimizer steps"}
    if llm is not None:
        engine = engine_resolved(llm.llm_engine.config)
        provenance.update(model=engine["model"], engine=engine)
    return write_traces(path, rows, provenance=provenance)
