#!/usr/bin/env bash
# Forty-sixth session, call B (call A found no machine; one call left in the budget): the lane on the session's final
# code (rule 3 with the twin; the twin under TP and dispatched EP), then, in the time left, call A's validation: correct
# backends on random fp32 cases through the runner on the GPU, ours and vLLM 0.33.0's and SGLang 0.5.23's.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s46lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/cB; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( ${CALL_BUDGET:-580} - ($(date +%s) - T0) )); }
V=bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py
for job in "triton_experts expert" "examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op" "triton_one_shot op" \
           "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert" \
           "examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP op"; do
  set -- $job
  [ $(left) -lt 45 ] && break
  timeout $(( $(left) - 10 )) python3 $V $1 3000 $(( $(left) < 75 ? $(left) - 30 : 45 )) 31 cuda $2 >> $L/validation.txt 2>&1
  echo "$1 $2 rc=$? [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
cd $OUT && tar czf cB.tgz cB && rm -rf cB
