#!/usr/bin/env bash
# Forty-seventh session, call 3 (the warm H100, the budget's last minutes): call 2's small-row validation again after
# its finding (a one-token case's reordered view was refused as malformed: the T >= 2 check is the token views' alone).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c3; mkdir -p $L
S=bench/results/2026-12-07-cpu-s47/small_rows_validation.py
for job in "triton_experts expert 51" "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert 52" \
           "examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op 53" "experts_oracle expert 54"; do
  set -- $job
  timeout 50 python3 $S $1 3000 35 $3 cuda $2 2>&1 | grep -v "default MoE config" >> $L/validation.txt
  echo "$1 $2 [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
