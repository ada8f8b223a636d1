#!/usr/bin/env bash
# Forty-second session, call 4, on ddd8a24 (rule 4 over FP8 rows where the e4m3 products sum exactly, the twin on the
# reordered FP8 view): the GPU lane's tests, then FP8 power at Qwen3-30B-A3B's layer, 256 tokens (row tile 16: "fp32"
# declared, so the twin runs), rank 16, both schemes and dtypes.
set -u
cd "$(dirname "$0")/../../.."
bash ci/gpu_call_tests.sh s42c4tests
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c4; mkdir -p $L
for q in fp8_w8a8 fp8_block; do
  timeout 100 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q --tokens 256 \
    --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T256.json > $L/power_${q}_T256.txt 2>&1
  echo "power $q rc=$?"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T256.txt | cut -c1-140
done
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
