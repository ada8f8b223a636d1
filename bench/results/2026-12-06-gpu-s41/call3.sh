#!/usr/bin/env bash
# session 41, call 3 (call 2 never got a machine): the GPU lane's tests on this session's code (the FP8 accumulation
# declared per row tile, its GPU tests among them), then the FP8 power rows in both regimes as time allows.
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s)
bash ci/gpu_call_tests.sh c3lane
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
left() { echo $(( 590 - ($(date +%s) - T0) )); }
for q in fp8_w8a8 fp8_block; do
  [ $(left) -gt 30 ] || break
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc $? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|POWER" $L/power_$q.txt | cut -c1-200
done
if [ $(left) -gt 40 ]; then
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant fp8_w8a8 --tokens 1024 --dtype float16 --rank 16 --json $L/power_w8a8_1024.json > $L/power_w8a8_1024.txt 2>&1
  echo "power w8a8 1024 rc $? [$(( $(date +%s) - T0 ))s]"; grep -v WARN $L/power_w8a8_1024.txt | tail -18 | cut -c1-160
fi
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
