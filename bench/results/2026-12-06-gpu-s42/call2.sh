#!/usr/bin/env bash
# Forty-second session, call 2: the FP8 lane pieces the forty-first code never ran on a GPU (FP8 suites with more
# cases, check's FP8 rows) and FP8 power where row tiles are 64 (the warpgroup MMA emulated): Qwen3-30B-A3B, 1024 tokens.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider --moe-lora-device cuda -n 4 -rfE \
  src/moe_lora_harness/suites/experts/test_fp8_triton.py src/moe_lora_harness/suites/experts/test_fp8.py > $L/fp8_suites.log 2>&1
echo "fp8 suites rc=$?"; tail -2 $L/fp8_suites.log
timeout 150 python3 -m moe_lora_harness check --device cuda --feature "experts: fp8" --only triton_experts \
  --only gated_fast_experts --only triton_experts_dual_stream --only experts_oracle --only eager --cases-per-feature 4 \
  --json $L/check_fp8.json --markdown $L/check_fp8.md > $L/check_fp8.txt 2>&1
echo "check fp8 rc=$?"; tail -4 $L/check_fp8.txt | cut -c1-300
for q in fp8_w8a8 fp8_block; do
  timeout 110 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q --tokens 1024 \
    --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T1024.json > $L/power_${q}_T1024.txt 2>&1
  echo "power $q rc=$?"; tail -30 $L/power_${q}_T1024.txt | cut -c1-220
done
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
