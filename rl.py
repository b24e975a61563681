"""`replayllm.rl`: the RL loop's helpers (docs/rl.md), re-exported from entrypoints/rl.py.

The roof of the floors (docs/architecture.md): a root-level module above entrypoints/, which it re-exports;
nothing in the package imports it."""

from .entrypoints.rl import (
    Logprobs,
    MismatchStats,
    Reward,
    Rollout,
    StepRecord,
    group_advantages,
    grpo_loss,
    grpo_step,
    mismatch_stats,
    sample_rollouts,
    save_rollouts,
    trainer_logprobs,
)

__all__ = ["Logprobs", "MismatchStats", "Reward", "Rollout", "StepRecord", "group_advantages", "grpo_loss",
           "grpo_step", "mismatch_stats", "sample_rollouts", "save_rollouts", "trainer_logprobs"]
