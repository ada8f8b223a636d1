#!/usr/bin/env bash
# Fifty-first session, call 2 (the machine still warm): the correct backends call 1 had no time left for.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c2; mkdir -p $L
T0=$(date +%s) END=${END:-250} bash bench/gpu_validate.sh $L/validation.txt \
  "examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP op served 74" \
  "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert few_rows 75" \
  "triton_one_shot op served 76" "triton_experts expert few_rows 77" "eager expert served 78"
cut -c1-400 $L/validation.txt
