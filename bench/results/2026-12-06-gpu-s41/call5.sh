#!/usr/bin/env bash
# session 41, call 5 (calls 2-4 never got a machine; little device budget left): the FP8 accumulation declared per
# row tile, on the GPU: our experts against both emulations (the landing tests), the FP8 power rows at Qwen3-30B-A3B's
# layer (16 and 256 tokens: row tile 16, exact fp32 sums), the FP8 test files on CUDA, check's FP8 rows, as time allows.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c5; mkdir -p $L
T0=$(date +%s)
left() { echo $(( ${BUDGET:-280} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 100 python3 -m pytest -q -s -p no:cacheprovider -p no:xdist --moe-lora-device cuda \
  src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on" > $L/landing.log 2>&1
echo "landing rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "elements off|passed|failed" $L/landing.log | cut -c1-200
run_power() {
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $1 --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$1.json > $L/power_$1.txt 2>&1
  echo "power $1 rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|POWER" $L/power_$1.txt | cut -c1-200
}
[ $(left) -gt 40 ] && run_power fp8_w8a8
if [ $(left) -gt 40 ]; then
  timeout $(left) python3 -m pytest -q -p no:cacheprovider --moe-lora-device cuda -n 4 -rfE \
    src/moe_lora_harness/suites/experts/test_fp8_triton.py src/moe_lora_harness/suites/experts/test_fp8.py \
    src/moe_lora_harness/suites/reference/test_fp8_mma.py -k "not land_on" > $L/fp8_suites.log 2>&1
  echo "fp8 suites rc $? [$(( $(date +%s) - T0 ))s]"; tail -3 $L/fp8_suites.log | cut -c1-300
fi
[ $(left) -gt 40 ] && run_power fp8_block
cd $OUT && tar czf c5.tgz c5 && rm -rf c5
