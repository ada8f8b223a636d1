#!/usr/bin/env bash
# Fifty-fourth session, call 2 (call 1 was refused every time it was tried): the GPU lane (ci/gpu_call_tests.sh) with
# rule 4's column blocks, the per-element FP8 flip squares and decode rows pooled to 332, then as much of call 1 (the
# digested input snapshot at DeepSeek-V3's FP8 rows) as the call's time leaves.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s54lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
left() { echo $(( ${END:-585} - ($(date +%s) - T0) )); }
if (( $(left) > 90 )); then
  timeout $(( $(left) - 10 )) python3 -m moe_lora_harness check --device cuda --model deepseek-v3 --tokens 16,100 \
    --feature fp8 --only triton_experts -q --json $L/check_deepseek_v3.json > $L/check_deepseek_v3.txt 2>&1
  echo "check deepseek-v3 rc $? [$(( $(date +%s) - T0 ))s]"
  grep -E "fp8|runs|NOTE|GiB|memory" $L/check_deepseek_v3.txt | cut -c1-250
fi
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
