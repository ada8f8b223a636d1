#!/usr/bin/env bash
# Forty-fourth session, call 2: no false verdict on the GPU from rule 3's floors without the scale arithmetic's flips
# for our kernels (declared to round at their model's points): check --model qwen3-30b-a3b's FP8 rows at 1, 16 and 100
# tokens for our three expert backends, then random FP8 cases of 1-300 rows through the runner on the GPU
# (bench/results/2026-12-06-cpu-s44/fp8_points_only_validation.py) for our Triton experts and the dual-stream ones.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c2; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 200 python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1,16,100 --feature fp8 \
  --only triton_experts --only triton_experts_dual_stream --only experts_oracle -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "runs|pass|FAIL|fail" $L/check_fp8.txt | tail -8 | cut -c1-250
V=bench/results/2026-12-06-cpu-s44/fp8_points_only_validation.py
timeout 170 python3 $V triton_experts 100000 150 3 cuda > $L/validation_triton_experts.txt 2>&1
echo "validation rc $? [$(( $(date +%s) - T0 ))s]"; head -c 1500 $L/validation_triton_experts.txt
timeout 150 python3 $V triton_experts_dual_stream 100000 120 4 cuda > $L/validation_dual_stream.txt 2>&1
echo "validation rc $? [$(( $(date +%s) - T0 ))s]"; head -c 1500 $L/validation_dual_stream.txt
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
