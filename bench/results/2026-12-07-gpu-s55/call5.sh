#!/usr/bin/env bash
# Fifty-fifth session, call 5 (after the lane: ../2026-12-07-gpu-s54/call2.sh or call3.sh): rule 4's column blocks
# (fifty-fourth session) on correct backends through the runner on the GPU: random cases of 115-400 rows (every
# row set past the blocks' threshold) in every dtype (bench/validate_correct.py --preset columns --dtype any), ours
# and vLLM 0.33.0's op and expert class (carried in .thirdparty: VLLM_SOURCE), then FP8 decode calls pooled to
# 83-360 rows; then a minute of layer-level fuzz (the GPU's layer draws reach 256 tokens: the blocks run there too).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0
T0=$(date +%s)
T0=$T0 END=${END:-500} bash bench/gpu_validate.sh $OUT/c5/validate.txt \
  "triton_experts expert columns 55 cuda any" "triton_one_shot op columns 56 cuda any" \
  "examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op columns 57 cuda any" \
  "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert columns 58 cuda any" \
  "triton_experts_dual_stream expert columns 59 cuda any" "triton_small_batch op columns 60 cuda any" \
  "triton_experts fp8_decode served 61 cuda" "gated_fast_experts expert columns 62 cuda any" \
  "triton_two_kernel op columns 63 cuda any" "oai_experts expert columns 64 cuda any"
grep -E "cases|FAIL" $OUT/c5/validate.txt | cut -c1-300
left=$(( 575 - ($(date +%s) - T0) ))
if (( left > 40 )); then
  timeout $(( left - 5 )) python3 -m moe_lora_harness fuzz --only layer_triton --level layer --device cuda \
    --budget $(( left - 25 ))s -q --out $OUT/c5/fuzz_layer > $OUT/c5/fuzz_layer.txt 2>&1
  echo "layer fuzz rc $?"; tail -n 2 $OUT/c5/fuzz_layer.txt
fi
