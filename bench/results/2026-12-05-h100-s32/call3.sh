#!/usr/bin/env bash
# session 32, call 3: correct kernels fuzzed at served shapes (issue 30 item 3: toward 10,000 GPU examples), our
# triton_experts, `fuzz --model M --jobs 8`, each catalogued model in turn (B seconds each, Qwen3-235B-A22B last
# with what is left).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c3; mkdir -p $L
T0=$(date +%s)
B=${B:-55}
for m in $(python3 -c "from moe_lora_harness.harness.served.models import MODELS; print(' '.join(m.name for m in MODELS if m.name != 'qwen3-235b-a22b'))") qwen3-235b-a22b; do
  left=$(( ${TOTAL:-570} - ($(date +%s) - T0) ))
  (( left > 60 )) || { echo "$m: no time left"; continue; }
  b=$B; [[ $m == qwen3-235b-a22b ]] && b=$(( left - 40 ))
  timeout $(( b + 35 )) python3 -m moe_lora_harness fuzz --device cuda --model "$m" --only triton_experts --jobs 8 \
    --budget ${b}s -q --no-db --out "$L/served_$m" > "$L/served_$m.txt" 2>&1
  echo "$m: rc $? $(tail -1 "$L/served_$m.txt" | cut -c1-200)"
done | tee $L/served_summary.txt
echo "call 3: $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
