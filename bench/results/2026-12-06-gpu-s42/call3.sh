#!/usr/bin/env bash
# Forty-second session, call 3: FP8 power where no row had measured it: Qwen3-30B-A3B at 4113 tokens (row tile 64,
# the warpgroup MMA emulated) and DeepSeek-V3, FP8 block as it is served, at 256 tokens.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
run() {   # name timeout args...
  local name=$1 t=$2; shift 2
  timeout $t python3 -m moe_lora_harness selftest --power --device cuda --rank 16 --json $L/$name.json "$@" > $L/$name.txt 2>&1
  echo "$name rc=$?"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/$name.txt | cut -c1-140
}
run power_fp8_w8a8_T4113 170 --model qwen3-30b-a3b --quant fp8_w8a8 --tokens 4096+17 --dtype bfloat16,float16
run power_fp8_block_T4113 170 --model qwen3-30b-a3b --quant fp8_block --tokens 4096+17 --dtype bfloat16,float16
run power_fp8_block_dsv3_T256 200 --model deepseek-v3 --quant fp8_block --tokens 256 --dtype bfloat16
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
