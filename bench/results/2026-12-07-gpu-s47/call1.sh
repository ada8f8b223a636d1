#!/usr/bin/env bash
# Forty-seventh session, call 1: the GPU lane on the session's judge (the twin below rule 4's rows for long fp32 rows;
# the whole tensor's rule 3 held to the twin's measure), then correct backends on random fp32 cases through the
# runner in the time left (bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py: rows 2-2048, served sizes),
# ours and vLLM 0.33.0's (its files carried in .thirdparty, kept out of the repository).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s47lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c1; mkdir -p $L
left() { echo $(( 575 - ($(date +%s) - T0) )); }
V=bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py
for job in "triton_experts expert 31" "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert 32" \
           "examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op 33" "triton_one_shot op 34" "experts_oracle expert 35"; do
  set -- $job
  l=$(left); (( l > 25 )) || { echo "$1: no time left"; continue; }
  t=$(( l < 60 ? l - 5 : 55 ))
  timeout $(( t + 15 )) python3 $V $1 3000 $t $3 cuda $2 >> $L/validation.txt 2>&1
  echo "$1 $2 rc=$? [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
