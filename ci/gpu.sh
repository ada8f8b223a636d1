#!/usr/bin/env bash
# GPU lane, run on the H200 through the device tool (never in CPU CI): the GPU suites, the conformance
# matrix on CUDA and the op benchmark. Everything lands in $OUT (default bench/results/latest).
#   usage: bash ci/gpu.sh [tests|check|bench|all] [extra bench args]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export MOE_LORA_HARNESS_MAX_EXAMPLES=${MOE_LORA_HARNESS_MAX_EXAMPLES:-5}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_env.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n ${WORKERS:-6} --device cuda \
    suites --durations=12 --junitxml="$OUT/gpu_junit.xml" 2>&1 | tail -80 > "$OUT/gpu_tests.log"
  rc=${PIPESTATUS[0]}
  tail -30 "$OUT/gpu_tests.log"
fi
if [[ $what == check || $what == all ]]; then
  timeout ${CHECK_TIMEOUT:-200} python3 -m harness.cli check --device cuda --json "$OUT/check_cuda.json" \
    --markdown "$OUT/check_cuda.md" > "$OUT/check_cuda.txt" 2>&1 || rc=1
  tail -5 "$OUT/check_cuda.txt"
fi
if [[ $what == bench || $what == all ]]; then
  timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_lora_op.py --anchors bench/anchors/vllm-0.33.0-fused_moe_lora-h200.json \
    --out "$OUT/bench_lora_op.json" --md "$OUT/bench_lora_op.md" "$@" > "$OUT/bench_lora_op.txt" 2>&1 || rc=1
  tail -8 "$OUT/bench_lora_op.txt"
fi
exit $rc
