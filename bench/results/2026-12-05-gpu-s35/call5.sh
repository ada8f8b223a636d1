#!/usr/bin/env bash
# session 35, call 5 (the device time left): the power row of GPT-OSS-20B in fp32 at 256 tokens with the twin
# (swigluoai's interleaved w13, biases: the layout the first reordered view got wrong).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c5; mkdir -p $L
T0=$(date +%s)
timeout ${TOTAL:-150} python3 -m moe_lora_harness selftest --power --device cuda --model gpt-oss-20b --tokens 256 \
  --dtype float32 --json $L/power_fp32_gptoss20b.json > $L/power_fp32_gptoss20b.txt 2>&1
echo "power gpt-oss-20b fp32 256 rc $? [$(( $(date +%s) - T0 ))s]"
grep -v WARN $L/power_fp32_gptoss20b.txt | tail -16
cd $OUT && tar czf c5.tgz c5 && rm -rf c5
