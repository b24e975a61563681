#!/usr/bin/env bash
# Session 49, call 1: every GPU test suite on this session's tree (rank rule in the logprobs kernel, sampler order,
# structured outputs after reasoning, ...), on an empty Triton cache
set -u
nvidia-smi -L
export TRITON_CACHE_DIR=$(mktemp -d)
TESTS_ONLY=1 timeout 575 bash bench/gpu_check.sh > $OUT/check.log 2>&1
echo "rc=$?"
grep -E "^\[|test suites|^(FAILED|ERROR) " $OUT/check.log | head -40
grep -h -E "^E  " $OUT/*.log | head -30
for f in $OUT/*.log; do echo "$f $(grep -c PASSED $f) passed $(grep -c FAILED $f) failed"; done
