#!/usr/bin/env bash
# session 32, call 2: issue 30's power table, the rows earlier calls did not finish: 16-token decode batches pooled
# over 16 calls (the T16 single call's oracle-only outputs), DeepSeek-V3 at 256 tokens; then served fuzz of our
# triton_experts at Qwen3-30B-A3B and Qwen3-235B-A22B in the time left (issue 30 item 3). The session's last call:
# call 3 (more fuzz) did not fit the device time left.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
P=(python3 -m moe_lora_harness selftest --power --device cuda -v)
while read -r name limit args; do
  (( $(left) > limit + 30 )) || { echo "power $name: no time left"; continue; }
  s0=$(date +%s)
  timeout $limit "${P[@]}" $args --json "$L/power_$name.json" > "$L/power_$name.txt" 2>"$L/power_$name.err"
  echo "power $name: rc $? $(grep -c "POWER FAILED" "$L/power_$name.txt") POWER FAILED [$(( $(date +%s) - s0 ))s]"
done <<'ROWS'
t16pooled 110 --model qwen3-235b-a22b --tokens 16 --calls 16 --dtype bfloat16,float16
dsv3 150 --model deepseek-v3 --tokens 256 --dtype bfloat16
ROWS
for m in qwen3-30b-a3b qwen3-235b-a22b; do
  (( $(left) > 70 )) || { echo "served $m: no time left"; continue; }
  b=$(( $(left) - 40 )); [[ $m == qwen3-30b-a3b ]] && b=$(( b / 2 ))
  timeout $(( b + 35 )) python3 -m moe_lora_harness fuzz --device cuda --model $m --only triton_experts \
    --jobs 8 --budget ${b}s -q --no-db --out $L/served_$m > $L/served_$m.txt 2>&1
  echo "served $m: rc $? $(tail -1 $L/served_$m.txt | cut -c1-200)"
done
echo "call 2: $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
