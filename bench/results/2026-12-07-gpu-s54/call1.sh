#!/usr/bin/env bash
# Fifty-fourth session, call 1: the worker's digested input snapshot (b3aac9f) on a GPU: check --model deepseek-v3's
# FP8 rows (16 tokens pooled, 100 alone; block and w8a8; fp16 and bf16), estimated at 76.4 GiB a case (106.4 before
# the digest: not runnable on an H100), then Qwen3-30B-A3B's FP8 rows for the three FP8 expert backends.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c1; mkdir -p $L
left() { echo $(( ${END:-585} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee $L/gpu.txt
timeout 380 python3 -m moe_lora_harness check --device cuda --model deepseek-v3 --tokens 16,100 --feature fp8 \
  --only triton_experts -q --json $L/check_deepseek_v3.json > $L/check_deepseek_v3.txt 2>&1
echo "check deepseek-v3 rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "fp8|runs|NOTE|GiB|memory" $L/check_deepseek_v3.txt | cut -c1-250
(( $(left) > 60 )) && timeout $(( $(left) - 10 )) python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b \
  --tokens 1,16,100 --feature fp8 --only triton_experts --only triton_experts_dual_stream --only experts_oracle -q \
  --json $L/check_qwen3_30b.json > $L/check_qwen3_30b.txt 2>&1
echo "check qwen3-30b-a3b rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "fp8|runs|NOTE" $L/check_qwen3_30b.txt | cut -c1-250
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
