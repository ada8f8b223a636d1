#!/usr/bin/env bash
# Fiftieth session, call 3: the GPU lane on the fp32 one-shot fix (its expand's delta added once), call 1's failing
# case replayed, the short-sums validation of our one-shot op again (call 1's seed), vLLM 0.33.0's op power.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s50lane_fix
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c3; mkdir -p $L
FCASE='{"E":8,"H":2,"I":36,"T":157,"block_size_m":32,"dtype":"float32","layout":"naive","mapping":"skewed","max_loras":4,"max_rank":16,"seed":244586,"shared_a":true,"top_k":1}'
timeout 60 python3 -m moe_lora_harness replay --case "$FCASE" --only triton_one_shot --device cuda > $L/replay.txt 2>&1
echo "replay rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
timeout 70 python3 bench/validate_correct.py triton_one_shot --level op --preset short_sums --device cuda --seconds 45 \
  --seed 63 2>&1 | grep -v "default MoE config" > $L/validation.txt
echo "validation rc=${PIPESTATUS[0]} [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
VOP=examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP
timeout 100 python3 -m moe_lora_harness selftest --power --device cuda --level op --backend $VOP --only vllm_op -q \
  --model qwen3-30b-a3b --tokens 256 --rank 16 --dtype float32 --json $L/op_power_vllm.json \
  > $L/op_power_vllm.txt 2>&1; echo "vllm power rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
cut -c1-300 $L/replay.txt | head -3; cat $L/validation.txt | cut -c1-400; grep -v "^(x" $L/op_power_vllm.txt | cut -c1-200
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
