#!/usr/bin/env bash
# The architectures' GPU checks alone, in one device call of a few minutes (bench/gpu_check.sh runs them inside its
# whole suite): the MoE / recurrent kernels' tests compiled, then concurrently on CUDA in fp32 the model files of the
# hybrid and per-layer-shape architectures and test_engine_architectures.py's CUDA-vs-CPU engine comparison and
# logprobs against transformers for the architectures ARCHS_K selects (default: those added in sessions 43 and 44).
#   run: bash bench/gpu_archs_check.sh   (logs in $OUT: kernels.log, models.log, archs.log)
set -uo pipefail
source "$(dirname "$0")/gpu_setup.sh"
DEFAULT_K="gemma4 or lfm or bamba or falcon_h1 or olmo_hybrid or nemotron_h or jamba or mamba or zamba2"
DEFAULT_K="$DEFAULT_K or gemma3n or youtu or minicpm or mellum or cohere2_moe or afmoe or deepseek_v32 or glm_moe_dsa or codegen or dbrx or persimmon or axk1 or axk2 or dots3_note or qwen4_exp or flint or kolibri1 or xglm or apertus1p5 or mimo_v2_flash or longcat_flash or laguna or jetmoe or kimi_linear or openai_gpt or beam or hrm_text or sarvam or param2moe or iquestcoder or lara_mini or minimax_text or bailing_hybrid or hy_v4 or inkling"
ARCHS_K=${ARCHS_K:-$DEFAULT_K}
cuda=(env REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=float32 REPLAYLLM_TEST_GPU_SHARE=0.25)
python3 -m pytest -v -p no:cacheprovider tests/kernels/test_fused_moe_kernel.py tests/kernels/test_gated_delta.py \
  tests/kernels/test_mamba_ssm.py tests/kernels/test_fused_moe_clamps.py > "$OUT/kernels.log" 2>&1 &
"${cuda[@]}" python3 -m pytest -v -p no:cacheprovider tests/models/test_hybrid_models.py tests/models/test_gemma4.py \
  tests/models/test_lfm2.py -k "not interpreter" > "$OUT/models.log" 2>&1 &
"${cuda[@]}" python3 -m pytest -v -p no:cacheprovider tests/models/test_engine_architectures.py \
  -k "($ARCHS_K) and (cuda_engine or logprobs)" > "$OUT/archs.log" 2>&1 &
rc=0
for job in $(jobs -p); do wait "$job" || rc=1; done
for log in kernels models archs; do echo "[$log] $(tail -1 "$OUT/$log.log")"; done
grep -h -E "^(FAILED|ERROR) " "$OUT"/kernels.log "$OUT"/models.log "$OUT"/archs.log | head -40
for log in "$OUT"/kernels.log "$OUT"/models.log "$OUT"/archs.log; do
  grep -q -E "^(FAILED|ERROR) " "$log" && { echo "--- $log"; grep -E "^_{3,} .* _{3,}$|^E   " "$log" | head -40; }
done
exit $rc
