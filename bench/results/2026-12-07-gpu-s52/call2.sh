#!/usr/bin/env bash
# Fifty-second session, call 2: no false verdict from FP8 decode calls pooled in model mode: check --model's FP8 rows
# at Qwen3-30B-A3B (1, 16 and 100 tokens: the first two now pooled calls) for our three FP8 expert backends, and at
# DeepSeek-V3 (16 tokens pooled, 100 alone), whose block FP8 row runs at its own layer since this session; then any
# power job call 1 had no time for.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c2; mkdir -p $L
left() { echo $(( ${END:-580} - ($(date +%s) - T0) )); }
timeout 200 python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1,16,100 --feature fp8 \
  --only triton_experts --only triton_experts_dual_stream --only experts_oracle -q --json $L/check_qwen3_30b.json \
  > $L/check_qwen3_30b.txt 2>&1
echo "check qwen3-30b-a3b rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "fp8|runs|NOTE" $L/check_qwen3_30b.txt | cut -c1-250
timeout $(( $(left) < 120 ? $(left) : 120 )) python3 -m moe_lora_harness check --device cuda --model deepseek-v3 \
  --tokens 16,100 --feature fp8 --only triton_experts -q --json $L/check_deepseek_v3.json > $L/check_deepseek_v3.txt 2>&1
echo "check deepseek-v3 rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "fp8|runs|NOTE" $L/check_deepseek_v3.txt | cut -c1-250
for job in ${POWER_LEFT:-}; do
  q=${job%:*}; c=${job#*:}
  (( $(left) > 30 )) || { echo "power $q calls $c: no time left"; continue; }
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q \
    --tokens 16 --calls $c --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_calls$c.json > $L/power_${q}_calls$c.txt 2>&1
  echo "power $q calls $c rc=$? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_calls$c.txt | cut -c1-110
done
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
