#!/usr/bin/env bash
# session 32, call 1: the GPU lane's tests (`ci/gpu.sh tests`) on the thirty-first session's changes (the rank-guard
# test's device fixed, EP ranks as processes and layers guarded, the one-token and two-K-tile check rows), then the
# power table's decode row (256 calls of one token, pooled: issue 30's answer for T=1), then the judge's time at
# DeepSeek-V3, 16384 tokens (issue 30 item 4: within 22.6 s on the H200).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c1; mkdir -p $L
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
TEST_TIMEOUT=360 CPU_FULL_TIMEOUT=120 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -6
echo "lane tests: $(( $(date +%s) - T0 )) s"
grep -E "^FAILED|^ERROR" $L/gpu_suites.log $L/cpu_full_tier.log | head -30 | cut -c1-300
t=$(date +%s)
timeout $(( $(left) > 220 ? 170 : $(left) - 50 )) python3 -m moe_lora_harness selftest --power --device cuda -v \
  --model qwen3-235b-a22b --tokens 1 --calls 256 --dtype bfloat16 --json $L/power_decode.json \
  > $L/power_decode.txt 2> $L/power_decode.err
echo "power decode: rc $? $(grep -c 'POWER FAILED' $L/power_decode.txt) POWER FAILED [$(( $(date +%s) - t ))s]"
if (( $(left) > 45 )); then
  t=$(date +%s)
  timeout $(( $(left) - 5 )) python3 bench/bench_judge.py --device cuda --models deepseek-v3 --tokens 16384 --repeats 1 \
    --out $L > $L/bench_judge.txt 2>&1
  echo "judge: rc $?, $(( $(date +%s) - t )) s"; tail -4 $L/bench_judge.txt | cut -c1-250
fi
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
