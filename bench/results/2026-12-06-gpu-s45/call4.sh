#!/usr/bin/env bash
# Forty-sixth session, call 4: call 1's second half, FP8 power past 3,644 tokens (4113 tokens at Qwen3-30B-A3B's layer,
# rank 16; rule 4 off there: the declared limit 3), both schemes, bf16 and fp16.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c4; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( 300 - ($(date +%s) - T0) )); }
for q in fp8_w8a8 fp8_block; do
  timeout $(( $(left) < 145 ? $(left) : 145 )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 4113 --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T4113.json > $L/power_${q}_T4113.txt 2>&1
  echo "power $q T4113 rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T4113.txt | cut -c1-100
done
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
