#!/usr/bin/env bash
# session 41, call 7 (the last device budget): the two LoRA landing rows with the test's mended bound, through the
# runner's verdict; then the FP8 w8a8 power rows at Qwen3-30B-A3B's layer as time allows.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c7; mkdir -p $L
timeout 60 python3 -m pytest -q -s -p no:cacheprovider -p no:xdist --moe-lora-device cuda \
  src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on and lora" > $L/landing.log 2>&1
echo "landing rc $?"; grep -E "elements off|passed|failed|Error" $L/landing.log | cut -c1-220
timeout 110 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
  --quant fp8_w8a8 --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_fp8_w8a8.json > $L/power_fp8_w8a8.txt 2>&1
echo "power rc $?"; grep -v WARN $L/power_fp8_w8a8.txt | tail -70 | cut -c1-150
