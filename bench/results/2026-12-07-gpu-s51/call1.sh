#!/usr/bin/env bash
# Fifty-first session, call 1: the GPU lane (ci/gpu_call_tests.sh) on the expand-onto-the-output diagnosis, the
# fiftieth session's failing case replayed on our one-shot op as it was before 355bb45 and as it is
# (bench/onto_output_replay.py), then correct op and expert backends on random fp32 cases (bench/gpu_validate.sh):
# ours, vLLM 0.33.0's and SGLang 0.5.23's (carried in .thirdparty).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s51lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c1; mkdir -p $L
for how in --as-before ""; do
  timeout 120 python3 bench/onto_output_replay.py --device cuda $how 2>&1 | grep -v "default MoE config" >> $L/replay.txt
done
VOP=examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP
VEX=examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS
SOP=examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP
T0=$T0 END=${END:-575} bash bench/gpu_validate.sh $L/validation.txt "triton_one_shot op short_sums 71" \
  "$VOP op few_rows 72" "triton_experts expert served 73" "$SOP op served 74" "$VEX expert few_rows 75" \
  "triton_one_shot op served 76"
cut -c1-600 $L/replay.txt
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
