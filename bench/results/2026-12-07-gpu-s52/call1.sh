#!/usr/bin/env bash
# Fifty-second session, call 1: the GPU lane (ci/gpu_call_tests.sh) on FP8 decode calls pooled in model mode and the
# block FP8 row at a served layer's sizes, then FP8 power at Qwen3-30B-A3B's layer (rank 16, our Triton experts):
# 16-token calls pooled eleven at a time (176 rows, as check --model now judges them) and one 16-token call alone.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s52lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c1; mkdir -p $L
left() { echo $(( ${END:-580} - ($(date +%s) - T0) )); }
for job in "fp8_block 11" "fp8_w8a8 11" "fp8_block 1" "fp8_w8a8 1"; do
  set -- $job
  (( $(left) > 30 )) || { echo "power $1 calls $2: no time left" | tee -a $L/skipped.txt; continue; }
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $1 \
    --tokens 16 --calls $2 --dtype bfloat16,float16 --rank 16 --json $L/power_$1_calls$2.json > $L/power_$1_calls$2.txt 2>&1
  echo "power $1 calls $2 rc=$? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_$1_calls$2.txt | cut -c1-110
done
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
