#!/usr/bin/env bash
# The GPU checks owed since session 49, in one device call of under 10 minutes on an empty Triton cache (what a
# fresh machine meets): the logprobs kernel's rank rule (session 49) and the GPU tests; the engine-level tests of
# sessions 49-52 on CUDA in fp32 (structured outputs after reasoning, sleep mode, load_weights, trace replay e2e);
# the architectures' CUDA check (bench/gpu_archs_check.sh, with the fused-MoE kernel's clamped / clipped SwiGLU
# branches of session 52: tests/kernels/test_fused_moe_clamps.py); W1 / W4 side by side (bench/gpu_check.sh's rows).
#   run: bash bench/gpu_owed.sh   (with .whl/ carried: bench/fetch_wheels.sh)
set -u
source "$(dirname "$0")/gpu_setup.sh"
cd "$(dirname "$0")/.."
echo "=== kernels and GPU tests"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_logprobs_kernel.py tests/model_runner/test_gpu.py \
  -x 2>&1 | tail -3
echo "=== engine tests on CUDA (fp32)"
REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=float32 timeout 120 python3 -m pytest -q -p no:cacheprovider \
  tests/sampling/test_structured_after_reasoning.py tests/model_runner/test_sleep_mode.py \
  tests/model_runner/test_load_weights.py tests/engine/test_trace_replay_e2e.py -k "not interpreter and not guide" \
  2>&1 | grep -E "^FAILED|^E  |passed|failed" | head -20
echo "=== architectures"
timeout 150 bash bench/gpu_archs_check.sh 2>&1 | tail -15
echo "=== bench W1 W4"
BENCH_ONLY_ALL=1 BENCH_ONLY="W1 W4" SKIP_COLD=1 SKIP_RL=1 SKIP_MOE=1 SKIP_SERVE=1 SKIP_REPLAY=1 SKIP_DIFF=1 \
  timeout 150 bash bench/gpu_check.sh 2>&1 | tail -25
