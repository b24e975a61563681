#!/usr/bin/env bash
# Session 47, call 4: the architectures whose features.md rows say "not yet on a GPU", and the multimodal wrappers,
# on CUDA (fp32) against the machine's transformers
set -u
export ARCHS_K="ernie4_5_moe or cwm or vaultgemma or nanochat or gpt_neo or granite_swa or granitemoe_swa or dots1 or glm4_moe_lite or minimax_m2 or exaone or internlm3 or solar_open or flex_olmo or jais2 or hyperclovax or exaone_moe or hy_v3 or phimoe or hunyuan"
timeout 420 bash bench/gpu_archs_check.sh 2>&1 | tail -40
source bench/gpu_setup.sh > /dev/null
REPLAYLLM_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/models/test_multimodal_text.py \
  -k "test_the_wrapper_serves" 2>&1 | tail -25
