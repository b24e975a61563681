#!/usr/bin/env bash
# Session 47: S1 served / engine at max_num_seqs 256 (today's default) against 1024 (vLLM's default on a >= 70 GiB GPU)
set -u
ROOT=$OUT
export SKIP_TESTS=1 SKIP_E2E=1 SKIP_COLD=1 SKIP_RL=1 SKIP_MOE=1 SKIP_REPLAY=1 SKIP_DIFF=1 SKIP_SPEC=1
OUT=$ROOT/a BENCH_ONLY="W1 S1-engine" SERVE_ONLY="S1 S4" timeout 280 bash bench/gpu_check.sh > $ROOT/a.log 2>&1
OUT=$ROOT/b BENCH_ONLY="S1-engine" BENCH_ARGS="--max-num-seqs 1024" SERVE_ARGS="--max-num-seqs 1024" SERVE_ONLY="S1 S4" timeout 250 bash bench/gpu_check.sh > $ROOT/b.log 2>&1
for d in a b; do grep -h "ready\|start-up\|captur\|late kernel" $ROOT/$d/serve_S1.log | head -8; done > $ROOT/serve_lines.txt 2>&1
tail -40 $ROOT/a.log; tail -40 $ROOT/b.log
cd $ROOT && tar czf res.tgz a/*.json a/*.txt b/*.json b/*.txt a/*.md b/*.md serve_lines.txt 2>/dev/null; rm -rf a b
