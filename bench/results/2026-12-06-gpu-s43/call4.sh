#!/usr/bin/env bash
# Forty-third session, call 4: check --model's FP8 rows at 1024 and 2048 tokens (row tile 64, the truncating MMA: the
# twin with its own emulation) for the backends call 3's limit cut: no false verdict on a correct kernel.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c4; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 270 python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1024,2048 --feature fp8 \
  --only triton_experts_dual_stream --only experts_oracle -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "runs|pass|FAIL|fail|NOTE" $L/check_fp8.txt | tail -8 | cut -c1-250
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
