#!/usr/bin/env bash
# Fifty-third session: the GPU lane (ci/gpu_call_tests.sh) with the FP8 landing test's flip rows and the power table's
# oracle checked on other draws, then FP8 w8a8 fp16 power at Qwen3-30B-A3B's layer (rank 16, our Triton experts):
# 16-token calls pooled eleven at a time, and one such call alone, each with the oracle's other draws.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s53lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/power; mkdir -p $L
left() { echo $(( ${END:-580} - ($(date +%s) - T0) )); }
for calls in 11 1; do
  (( $(left) > 30 )) || { echo "power calls $calls: no time left" | tee -a $L/skipped.txt; continue; }
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant fp8_w8a8 \
    --tokens 16 --calls $calls --dtype float16 --rank 16 --json $L/power_fp8_w8a8_calls$calls.json \
    > $L/power_fp8_w8a8_calls$calls.txt 2>&1
  echo "power calls $calls rc=$? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|draw|POWER|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_fp8_w8a8_calls$calls.txt | cut -c1-160
done
