#!/usr/bin/env bash
# session 27, call 2: third parties on CUDA (vLLM 0.33.0's op and expert class from the wheel, carried in .thirdparty:
# check, check --model, fuzz --jobs 8 beside ours), then the FP8 check rows of every Triton experts backend
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c2; mkdir -p $L
t0=$(date +%s)
VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 THIRDPARTY_MODEL_BUDGET=60s OUT=$L timeout 400 bash ci/gpu.sh thirdparty 2>&1 | tail -12
echo "thirdparty: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout 150 python3 -m moe_lora_harness check --device cuda --feature "experts: fp8" --only triton_experts \
  --only gated_fast_experts --only triton_experts_dual_stream --only experts_oracle --only eager --cases-per-feature 4 \
  --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
tail -3 $L/check_fp8.txt | cut -c1-300
echo "fp8 check: $(( $(date +%s) - t1 )) s"
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
