#!/usr/bin/env bash
# Forty-eighth session, call 1: the GPU lane on the session's judge (the activation's flush), then correct backends
# on random fp32 cases in the time left: short sums and low ranks
# (bench/results/2026-12-07-cpu-s47/short_sums_validation.py), served sizes
# (bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py), ours and vLLM 0.33.0's (carried in .thirdparty).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
# the CPU judge's fingerprints under this machine's torch (suites/harness/judge_golden.py): the session changed one
# case's truth (an activation's flush in its underflow exposure); recorded here, compared with the old record at home
mkdir -p $OUT/golden && cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/before.json
PYTHONPATH=$PWD/src timeout 120 python3 -m moe_lora_harness.suites.harness.judge_golden --record > /dev/null 2>&1
cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/after.json
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s48lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c1; mkdir -p $L
END=${END:-500}   # seconds from the start when the validation stops (the device budget left decides)
left() { echo $(( END - ($(date +%s) - T0) )); }
V=bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py
S=bench/results/2026-12-07-cpu-s47/short_sums_validation.py
for job in "$S triton_one_shot op 51" "$S examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op 52" \
           "$S triton_experts expert 53" "$S examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert 54" \
           "$V examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op 55" "$V triton_experts expert 56"; do
  set -- $job
  l=$(left); (( l > 25 )) || { echo "$2: no time left"; continue; }
  t=$(( l < 45 ? l - 5 : 40 ))
  timeout $(( t + 15 )) python3 $1 $2 3000 $t $4 cuda $3 2>&1 | grep -v "default MoE config" >> $L/validation.txt
  echo "$2 $3 [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
