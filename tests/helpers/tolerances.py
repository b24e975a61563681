"""Float tolerances for the tests: derived from the dtype and the magnitude, never tuned on one CPU (issue 28).

The rule for every float comparison in tests/:
- Like with like -- both sides run the same code (same engine config, same batch shapes and prompt chunks, same
  trace_replay_chunk_size, same dtype): compare exactly (==, torch.equal). A difference there is a bug, or a
  path that is not the same after all.
- Two different computations of one value -- engine vs transformers, fast-replay chunks vs one-token steps,
  another batch or a recomputed prefill, a Triton kernel vs its torch reference: |a - b| <= rounding_tol(...).
  Which order a CPU's BLAS or SIMD code sums in changes with the CPU model (AVX2 vs AVX-512 blocking, FMA), so
  a bound measured on one machine fails on another (1.14e-5 on an AMD EPYC against a tuned 1e-5).
"""

from __future__ import annotations

import math

import torch


def magnitude(values) -> float:
    """max |x| of a number, a tensor, an array or a (nested) list of numbers."""
    if isinstance(values, (int, float)):
        return abs(float(values))
    t = torch.as_tensor(values, dtype=torch.float64) if not isinstance(values, torch.Tensor) else values
    return float(t.detach().abs().max()) if t.numel() else 0.0


def rounding_tol(scale, *, terms: int = 1, steps: int = 1, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |a - b| for two float computations of the same real number that differ only in rounding.

    One rounding moves a value by at most eps/2 of its magnitude (eps = torch.finfo(dtype).eps: 1.19e-7 for
    fp32). A sum of `terms` terms summed in another order (other blocking, SIMD width, kernel) is a random walk
    of `terms` roundings at the sum's scale: sigma ~ eps * sqrt(terms) * scale. A chain of `steps` such
    reductions (a model's layers) adds up their errors. The factor 8: 4 sigma (the largest of the thousands of
    values a test compares) on each of the two sides.

    scale: the magnitude the rounding happens at -- max |value| of what is compared (a number, tensor or list),
    floored at 1 (a value near 0 is still the sum of O(1) terms). For logprobs it is the logits' scale, not the
    logprob's (logprob = logit - logsumexp: it carries the logits' rounding). For an elementwise comparison pass
    scale=1 and use the result as rtol and atol (a relative bound per element).
    """
    return 8 * torch.finfo(dtype).eps * max(1.0, magnitude(scale)) * math.sqrt(terms) * steps


def log_softmax_tol(logits: torch.Tensor) -> float:
    """Bound on |a - b| for two fp32 computations of log_softmax of the same logits [..., V] (logsumexp vs
    log_softmax, a Triton kernel vs torch, or vs float64): x - (m + log sum exp(x - m)). The log of a V-term sum
    errs by the sum's relative rounding (scale 1, V terms); the shift and the subtraction round at the logits'
    scale."""
    finite = logits[logits.isfinite()].float()
    return rounding_tol(1, terms=logits.shape[-1]) + rounding_tol(finite, steps=2)


# The tests' models -- tests/helpers/hf_reference.py's and test_models.py's tiny random Qwen3/Llama/Qwen2, the embedded
# replayllm/tiny-qwen3 (all hidden 64, 2 layers) and conftest's tiny16 (hidden 32) -- in fp32. Their logits stay
# under |21| (random weights, initializer_range 0.5; measured on random prompts), scale 24; each logit ends
# num_hidden_layers + 1 (the head) chains of length-hidden reductions. The logprob of a token reported by two
# computations (engine vs transformers, another batch, chunk or schedule) therefore differ by at most:
TEST_MODEL_LOGIT_SCALE, TEST_MODEL_HIDDEN, TEST_MODEL_LAYERS = 24, 64, 2
LOGPROB_TOL = rounding_tol(TEST_MODEL_LOGIT_SCALE, terms=TEST_MODEL_HIDDEN, steps=TEST_MODEL_LAYERS + 1)
# = 5.5e-4: 5-10x the largest differences seen on a CPU (5.6e-5: the tiny Llama's logprobs, one-token steps vs
# fast-replay chunks; 1.1e-4: test_models.py's Llama logits, decode steps vs one prefill), and ~20x under what a
# wrong token, position or mask does to a logprob (>= 1e-2). Logits compare within the same bound.
