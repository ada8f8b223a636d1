#!/usr/bin/env bash
# Forty-fifth session, call 1 (the forty-fourth session's final judging code; its call 3, never run): FP8 power at Qwen3-30B-A3B's layer, rank 16, at 2048
# tokens (row tile 64: both MMA emulations fit MMA_PRODUCTS_MAX, so the twin runs and rule 4 judges) and at 4113 tokens
# (past 3,644 tokens: rule 4 off, the declared limit), both schemes, bf16 and fp16, in what time is left.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c3; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( 580 - ($(date +%s) - T0) )); }
for T in 2048 4113; do
  for q in fp8_w8a8 fp8_block; do
    timeout $(( $(left) < 140 ? $(left) : 140 )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
      --quant $q --tokens $T --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T$T.json > $L/power_${q}_T$T.txt 2>&1
    echo "power $q T$T rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T$T.txt | cut -c1-100
  done
done
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
