#!/usr/bin/env bash
# Fiftieth session, call 1: the GPU lane (ci/gpu_call_tests.sh) on the op-level twin's scaled B, then correct op-level
# backends on random fp32 cases (bench/validate_correct.py) in the time left: ours, vLLM 0.33.0's and SGLang 0.5.23's
# (carried in .thirdparty).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s50lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c1; mkdir -p $L
END=${END:-570}   # seconds from the start when the validation stops
left() { echo $(( END - ($(date +%s) - T0) )); }
VOP=examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP
for job in "triton_one_shot op served 61" "$VOP op served 62" "triton_one_shot op short_sums 63"; do
  set -- $job
  l=$(left); (( l > 25 )) || { echo "$1 $2 $3: no time left" | tee -a $L/validation.txt; continue; }
  t=$(( l < 45 ? l - 5 : 40 ))
  echo "== $1 $2 $3 seed $4 (${t}s)" >> $L/validation.txt
  timeout $(( t + 20 )) python3 bench/validate_correct.py $1 --level $2 --preset $3 --device cuda --seconds $t \
    --seed $4 2>&1 | grep -v "default MoE config" >> $L/validation.txt
  echo "$1 $2 $3 rc=${PIPESTATUS[0]} [$(( $(date +%s) - T0 ))s]" | tee -a $L/validation.txt
done
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
