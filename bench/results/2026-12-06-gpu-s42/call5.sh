#!/usr/bin/env bash
# Forty-second session, call 5 (rule 4 over FP8 rows without the scale arithmetic's slack for a backend declared to
# round at its model's points): the FP8 suites and check's FP8 rows on CUDA, then FP8 power at 256 tokens again.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c5; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider --moe-lora-device cuda -n 4 -rfE \
  src/moe_lora_harness/suites/experts/test_fp8_triton.py src/moe_lora_harness/suites/experts/test_fp8.py > $L/fp8_suites.log 2>&1
echo "fp8 suites rc=$?"; tail -1 $L/fp8_suites.log
for q in fp8_w8a8 fp8_block; do
  timeout 100 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q --tokens 256 \
    --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T256.json > $L/power_${q}_T256.txt 2>&1
  echo "power $q rc=$?"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T256.txt | cut -c1-100
done
cd $OUT && tar czf c5.tgz c5 && rm -rf c5
