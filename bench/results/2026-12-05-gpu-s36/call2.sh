#!/usr/bin/env bash
# session 36, call 2: the power row the last session could not run (GPT-OSS-20B in fp32 at 256 tokens with the twin:
# swigluoai's interleaved w13 and biases), then the fp32 router-weight rows at Qwen3-30B-A3B's routing (256 tokens,
# ranks 16 and 32) for the record this session's rule 4 work starts from.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
T0=$(date +%s)
timeout 200 python3 -m moe_lora_harness selftest --power --device cuda --model gpt-oss-20b --tokens 256 \
  --dtype float32 --json $L/power_fp32_gptoss20b.json > $L/power_fp32_gptoss20b.txt 2>&1
echo "power gpt-oss-20b fp32 256 rc $? [$(( $(date +%s) - T0 ))s]"
grep -v WARN $L/power_fp32_gptoss20b.txt | tail -18
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
