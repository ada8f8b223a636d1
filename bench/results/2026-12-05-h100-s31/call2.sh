#!/usr/bin/env bash
# session 31, call 2: issue 30's power table on the H200 (`ci/gpu.sh power`'s rows, each cut to fit one call; the
# JSON is written after every case, so a cut row keeps its finished cases), then the judge fingerprints of this
# build (judge_golden --record).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
T0=$(date +%s)
P=(python3 -m moe_lora_harness selftest --power --device cuda -v)
while read -r name limit args; do
  s0=$(date +%s)
  timeout $limit "${P[@]}" $args --json "$L/power_$name.json" > "$L/power_$name.txt" 2>"$L/power_$name.err"
  echo "power $name: rc $? $(grep -c "POWER FAILED" "$L/power_$name.txt") POWER FAILED [$(( $(date +%s) - s0 ))s]"
done <<'ROWS'
q235 210 --model qwen3-235b-a22b --tokens 1,16,256,4096+17 --dtype bfloat16,float16
more 120 --model deepseek-v3 --model mixtral-8x7b --tokens 256,4096+17 --dtype bfloat16
fp32_ranks 110 --model qwen3-30b-a3b --tokens 256,4096+17 --dtype float32,bfloat16 --rank 16,32
decode 60 --model qwen3-235b-a22b --tokens 1 --calls 256 --dtype bfloat16
ROWS
grep -h "POWER FAILED" $L/power_*.txt | cut -c1-200
t=$(date +%s)
timeout 50 python3 -m moe_lora_harness.suites.harness.judge_golden --record > $L/judge_golden.txt 2>&1
echo "judge_golden --record: rc $? $(( $(date +%s) - t )) s"
cp suites/harness/judge_golden_builds.json $L/
echo "call 2: $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
