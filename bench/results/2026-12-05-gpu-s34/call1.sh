#!/usr/bin/env bash
# session 34, call 1: the GPU lane's tests on the code with rule 4's weighted expert sets (never run on a GPU before),
# then the power row they aim at: Qwen3-235B-A22B at 4113 tokens, bf16 (one expert's delta was 0.265 against
# assert_close's 0.256 before them).
set -u
T0=$(date +%s)
L=$OUT/c1; mkdir -p $L
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} bash ci/gpu.sh tests 2>&1 | tail -8 | tee $L/tests_summary.txt
echo "tests: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
left=$(( ${TOTAL:-570} - ($(date +%s) - T0) ))
timeout $left python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-235b-a22b --tokens 4096+17 \
  --dtype bfloat16 --json $L/power_q235_4113.json > $L/power_q235_4113.txt 2>&1
echo "power q235 4113: rc $? $(grep -c 'POWER FAILED' $L/power_q235_4113.txt) POWER FAILED" | tee -a $L/tests_summary.txt
echo "c1: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
