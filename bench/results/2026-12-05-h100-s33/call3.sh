#!/usr/bin/env bash
# session 33, call 3: the power table's rows never measured on a GPU: the other catalogued models at 256 tokens,
# bf16 (ci/gpu.sh power's `others` row), each model its own selftest so that a cut keeps the finished ones.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
T0=$(date +%s)
TOTAL=${TOTAL:-270}
for m in ${MODELS:-gpt-oss-20b nemotron-3-nano-30b-a3b gpt-oss-120b mixtral-8x22b}; do
  left=$(( TOTAL - ($(date +%s) - T0) ))
  (( left > 40 )) || { echo "power $m: no time left"; continue; }
  s0=$(date +%s)
  timeout $left python3 -m moe_lora_harness selftest --power --device cuda --model $m --tokens 256 --dtype bfloat16 \
    --json "$L/power_$m.json" > "$L/power_$m.txt" 2>"$L/power_$m.err"
  echo "power $m: rc $? $(grep -c "POWER FAILED" "$L/power_$m.txt") POWER FAILED [$(( $(date +%s) - s0 ))s]"
done | tee $L/power_summary.txt
echo "c3: $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
