#!/usr/bin/env bash
# session 41, call 4 (calls 2 and 3 never got a machine; the device budget left no room for the whole lane): the
# lane's FP8 part on this session's code (the FP8 test files on CUDA, check's FP8 rows over five backends, 6 cases a
# feature) and the FP8 power rows at Qwen3-30B-A3B's layer, 16 and 256 tokens (row tile 16: exact fp32 sums).
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c4; mkdir -p $L
T0=$(date +%s)
left() { echo $(( ${BUDGET:-430} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 150 python3 -m pytest -q -s -p no:cacheprovider --moe-lora-device cuda -n 4 -rfE \
  src/moe_lora_harness/suites/experts/test_fp8_triton.py src/moe_lora_harness/suites/experts/test_fp8.py \
  src/moe_lora_harness/suites/reference/test_fp8_mma.py -k "not land_on" > $L/fp8_suites.log 2>&1
echo "fp8 suites rc $? [$(( $(date +%s) - T0 ))s]"; tail -3 $L/fp8_suites.log | cut -c1-300
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -p no:xdist --moe-lora-device cuda \
  src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on" > $L/landing.log 2>&1
echo "landing rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "elements off|passed|failed" $L/landing.log | cut -c1-200
for q in fp8_w8a8 fp8_block; do
  [ $(left) -gt 30 ] || break
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc $? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|POWER" $L/power_$q.txt | cut -c1-200
done
if [ $(left) -gt 40 ]; then
  timeout $(left) python3 -m moe_lora_harness check --device cuda --feature "experts: fp8" \
    --only triton_experts --only gated_fast_experts --only triton_experts_dual_stream --only experts_oracle \
    --only eager --cases-per-feature 6 --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
  echo "check fp8 rc $? [$(( $(date +%s) - T0 ))s]"; tail -4 $L/check_fp8.txt | cut -c1-300
fi
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
