#!/usr/bin/env bash
# session 34, call 4 (what device time was left): two more rows where one expert's delta sat at assert_close's
# threshold before the weighted sets (Qwen3-30B-A3B rank 32 at 4113 tokens: 0.27 against 0.28; DeepSeek-V3 at 4113:
# 0.20 against 0.20), bf16; each its own selftest so that a cut keeps the first.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c4; mkdir -p $L
T0=$(date +%s)
for row in "qwen3-30b-a3b 32" "deepseek-v3 64"; do
  read -r m r <<< "$row"
  left=$(( ${TOTAL:-200} - ($(date +%s) - T0) ))
  (( left > 20 )) || { echo "power $m: no time left"; continue; }
  timeout $left python3 -m moe_lora_harness selftest --power --device cuda --model $m --tokens 4096+17 --dtype bfloat16 \
    --rank $r --json "$L/power_${m}_4113.json" > "$L/power_${m}_4113.txt" 2>&1
  echo "power $m r$r: rc $? [$(( $(date +%s) - T0 ))s]"
done | tee $L/power_summary.txt
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
