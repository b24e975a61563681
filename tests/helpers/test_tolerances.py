"""tests/helpers/tolerances.py: the derived float bounds the other tests compare with (no engine here)."""

from __future__ import annotations

import math

import numpy as np
import torch

from helpers.tolerances import LOGPROB_TOL, log_softmax_tol, magnitude, rounding_tol


def test_magnitude_of_numbers_tensors_arrays_and_lists():
    assert magnitude(-3) == 3.0 and magnitude(2.5) == 2.5
    assert magnitude(torch.tensor([[1.0, -7.0], [2.0, 3.0]])) == 7.0
    assert magnitude(np.array([0.5, -1.5], dtype=np.float32)) == 1.5
    assert magnitude([[-4.0, 1.0], [2.0, 0.0]]) == 4.0
    assert magnitude(torch.empty(0)) == 0.0


def test_bounds_follow_eps_scale_terms_and_steps():
    eps = torch.finfo(torch.float32).eps
    assert rounding_tol(0.1) == rounding_tol(1) == 8 * eps  # scale floored at 1
    assert rounding_tol(24, terms=64, steps=3) == 8 * eps * 24 * 8 * 3
    assert rounding_tol(1, dtype=torch.bfloat16) == 8 * torch.finfo(torch.bfloat16).eps
    logits = torch.tensor([[3.0, -20.0, float("-inf"), 1.0]])
    assert math.isclose(log_softmax_tol(logits), 8 * eps * 2 + 8 * eps * 20 * 2)


def test_the_model_logprob_bound_sits_between_rounding_and_a_real_bug():
    # Far above what fp32 rounding moves a test model's logprob by (<= 1.1e-4 seen on a CPU), far below what a
    # wrong token, position or mask does (>= 1e-2): a change that breaks either side should be deliberate.
    assert 2e-4 < LOGPROB_TOL < 1e-3
