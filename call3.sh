#!/usr/bin/env bash
# Session 47, call 3: the issue-34 rows side by side (on whichever card comes; an H200 if one does)
set -u
ROOT=$OUT
export SKIP_TESTS=1 SKIP_E2E=1 SKIP_RL=1 SKIP_MOE=1 SKIP_REPLAY=1 SKIP_DIFF=1 SKIP_SPEC=1 SKIP_COLD=1
OUT=$ROOT/d BENCH_ONLY="W1 W1-inv W4 S1-engine" SERVE_ONLY="S1" timeout 420 bash bench/gpu_check.sh > $ROOT/d.log 2>&1
grep -h "Request throughput\|Median TTFT\|Median TPOT" $ROOT/d/S1.txt
tail -12 $ROOT/d.log | grep "^|"
cd $ROOT && tar czf res3.tgz d/*.json d/*.md 2>/dev/null; rm -rf d
