#!/usr/bin/env bash
# Forty-fourth session, call 1: the lane's tests on fb9df54 (rule 3's floors allow a backend declared to round at its
# model's points no scale-arithmetic flips), then FP8 power at Qwen3-30B-A3B's layer, rank 16, 16, 256 and 1024 tokens
# (row tiles 16, 16 and 64), both schemes, bf16 and fp16, in what time is left.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s44lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c1; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $L/gpu_env.txt
left() { echo $(( 585 - ($(date +%s) - T0) )); }
for q in fp8_w8a8 fp8_block; do
  timeout $(( $(left) < 130 ? $(left) : 130 )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256,1024 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_$q.txt | cut -c1-100
done
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
