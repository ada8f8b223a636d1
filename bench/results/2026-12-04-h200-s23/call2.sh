#!/usr/bin/env bash
# session 23, call 2 (issue 30): our Triton backends declared model_points_only on CUDA (backends/rounding.py):
# check over every built-in, the power table at served shapes (decode to prefill), fuzz of each correct backend
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
R=$OUT/c2; mkdir -p $R
t0=$(date +%s)
timeout 200 python3 -m moe_lora_harness check --device cuda --json $R/check_cuda.json > $R/check_cuda.txt 2>&1
echo "check rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 $R/check_cuda.txt | cut -c1-300)"
t1=$(date +%s)
timeout 170 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-235b-a22b --tokens 1,16,256,4096+17 \
  --dtype bfloat16,float16 --json $R/power_q235.json > $R/power_q235.txt 2>&1
echo "power q235 rc=$? $(( $(date +%s) - t1 )) s"
timeout 100 python3 -m moe_lora_harness selftest --power --device cuda --model mixtral-8x7b --model deepseek-v3 \
  --tokens 256,4096+17 --dtype bfloat16 --json $R/power_more.json > $R/power_more.txt 2>&1
echo "power more rc=$? $(( $(date +%s) - t1 )) s"
grep -h "POWER FAILED" $R/power_*.txt | cut -c1-200
for b in triton triton_experts gated_fast_experts oai_experts marlin_experts triton_experts_dual_stream; do
  s=$(date +%s)
  timeout 50 python3 -m moe_lora_harness fuzz --device cuda --only $b --jobs 8 --budget 20s -q --no-db --out $R/fuzz_$b > $R/fuzz_$b.txt 2>&1
  echo "fuzz $b rc=$? $(( $(date +%s) - s )) s: $(grep -E 'examples' $R/fuzz_$b.txt | tail -1 | cut -c1-200)"
done
echo "total $(( $(date +%s) - t0 )) s"
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
