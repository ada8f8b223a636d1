#!/usr/bin/env bash
# session 41, call 2: the FP8 accumulation declared per row tile (exact fp32 sums under 64 rows: mma.sync; the
# warpgroup MMA promoted every 128 from 64): our experts against both emulations (tests), the FP8 power rows in both
# regimes (16 and 256 tokens: row tile 16; 1024 tokens: 64), check --model's FP8 rows with 4113 tokens.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
T0=$(date +%s)
timeout 150 python3 -m pytest -q -s -p no:cacheprovider src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on or declared_mma or statistical_accumulation or reads_each" \
  src/moe_lora_harness/suites/reference/test_fp8_mma.py > $L/tests.txt 2>&1
echo "tests rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "elements off|passed|failed|Error" $L/tests.txt | tail -16
for q in fp8_w8a8 fp8_block; do
  timeout 150 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc $? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|POWER" $L/power_$q.txt | cut -c1-240
done
timeout 120 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant fp8_w8a8 --tokens 1024 --dtype float16 --rank 16 --json $L/power_w8a8_1024.json > $L/power_w8a8_1024.txt 2>&1
echo "power w8a8 1024 rc $? [$(( $(date +%s) - T0 ))s]"; grep -v WARN $L/power_w8a8_1024.txt | tail -18 | cut -c1-200
timeout $(( 585 - ($(date +%s) - T0) )) python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1,7,64,4113 --feature fp8 \
  --only triton_experts --only experts_oracle --only triton_experts_dual_stream -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "runs|pass|FAIL|fail" $L/check_fp8.txt | tail -8
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
