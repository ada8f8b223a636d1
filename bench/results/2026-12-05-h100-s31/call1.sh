#!/usr/bin/env bash
# session 31, call 1: the GPU lane's tests (`ci/gpu.sh tests`) on the twenty-ninth and thirtieth sessions' changes
# (rules 2-4's terms, the guard bands on CUDA, the 256-wide fp8 block / int4 g128 check rows); then the judge's time
# at DeepSeek-V3, 16384 tokens (issue 30 item 4: within 22.6 s); then served fuzz in the time left.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c1; mkdir -p $L
T0=$(date +%s)
left() { echo $(( 575 - ($(date +%s) - T0) )); }
TEST_TIMEOUT=380 CPU_FULL_TIMEOUT=130 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -6
echo "lane tests: $(( $(date +%s) - T0 )) s"
grep -E "^FAILED|^ERROR" $L/gpu_suites.log $L/cpu_full_tier.log | head -30 | cut -c1-300
if (( $(left) > 70 )); then
  t=$(date +%s)
  timeout $(( $(left) > 130 ? 120 : $(left) - 10 )) python3 bench/bench_judge.py --device cuda --models deepseek-v3 \
    --tokens 16384 --repeats 1 --out $L > $L/bench_judge.txt 2>&1
  echo "judge: rc $?, $(( $(date +%s) - t )) s"; tail -4 $L/bench_judge.txt | cut -c1-250
fi
if (( $(left) > 50 )); then
  timeout $(( $(left) - 15 )) python3 -m moe_lora_harness fuzz --device cuda --model qwen3-235b-a22b --only triton_experts \
    --jobs 8 --budget $(( $(left) - 40 ))s -q --no-db --out $L/served_qwen3-235b-a22b > $L/served_qwen3-235b-a22b.txt 2>&1
  echo "served qwen3-235b-a22b: rc $? $(tail -1 $L/served_qwen3-235b-a22b.txt | cut -c1-200)"
fi
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
