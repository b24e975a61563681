#!/usr/bin/env bash
# Session 47, call 2: W4, the prefill tile A/B on S1's engine workload and W1, and the cold starts (offline, served)
set -u
ROOT=$OUT
export SKIP_TESTS=1 SKIP_E2E=1 SKIP_RL=1 SKIP_MOE=1 SKIP_REPLAY=1 SKIP_DIFF=1 SKIP_SPEC=1 SKIP_SERVE=1
OUT=$ROOT/c BENCH_ONLY="W4 S1-engine S1-engine-ptile S1-engine W1-ptile W1" timeout 500 bash bench/gpu_check.sh > $ROOT/c.log 2>&1
tail -60 $ROOT/c.log
cd $ROOT && tar czf res2.tgz c/*.json c/*.md 2>/dev/null; rm -rf c
