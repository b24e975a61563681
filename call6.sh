#!/usr/bin/env bash
# Session 48, call 1: the rows still "not yet on a GPU", the ERNIE-VL fix on CUDA, W1/W4 on whatever card came
set -u
ROOT=$OUT
nvidia-smi -L
export ARCHS_K="dbrx or persimmon or xglm or axk1 or flint or kolibri1 or apertus1p5 or lfm3 or minicpm5_moe or glm4"
timeout 300 bash bench/gpu_archs_check.sh 2>&1 | grep -E "^\[|FAILED|ERROR" | head -20
grep -E "PASSED|FAILED|SKIPPED" $OUT/archs.log | sed -E 's/.*::(test_[a-z_]+)\[([^]]+)\].*(PASSED|FAILED|SKIPPED).*/\2 \1 \3/' | sort | head -40
grep -E "^SKIPPED" $OUT/archs.log | head
rm -f $OUT/*.log
source bench/gpu_setup.sh > /dev/null
REPLAYLLM_TEST_DEVICE=cuda timeout 100 python3 -m pytest -q -p no:cacheprovider tests/models/test_multimodal_text.py \
  -k "test_the_wrapper_serves and (ernie or glm_ocr or paddleocr or fuyu or aya)" -rs 2>&1 | grep -E "^FAILED|^SKIPPED|passed|failed|^E +assert"
export SKIP_TESTS=1 SKIP_E2E=1 SKIP_COLD=1 SKIP_RL=1 SKIP_MOE=1 SKIP_REPLAY=1 SKIP_DIFF=1 SKIP_SPEC=1 SKIP_SERVE=1
OUT=$ROOT/a BENCH_ONLY="W1 W4" timeout 170 bash bench/gpu_check.sh > $ROOT/a.log 2>&1
tail -25 $ROOT/a.log
