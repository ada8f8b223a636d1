#!/usr/bin/env bash
# Forty-third session, call 2: rule 4 over FP8 rows under the truncating MMA (row tile 64), each twin held to its own
# emulation. The FP8 suites on CUDA (their landing rows of 161 tokens now run the twin), FP8 power at Qwen3-30B-A3B's
# layer with 1024 tokens (as the forty-second session's call 2, which had rule 4 off there), check --model's FP8 rows.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c2; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider --moe-lora-device cuda -n 4 -rfE -s \
  src/moe_lora_harness/suites/experts/test_fp8_triton.py src/moe_lora_harness/suites/experts/test_fp8.py > $L/fp8_suites.log 2>&1
echo "fp8 suites rc=$? [$(( $(date +%s) - T0 ))s]"; tail -2 $L/fp8_suites.log; grep -E "declared (128|fp32)" $L/fp8_suites.log | head -12
for q in fp8_w8a8 fp8_block; do
  timeout 130 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q --tokens 1024 \
    --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T1024.json > $L/power_${q}_T1024.txt 2>&1
  echo "power $q rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|rule 4|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T1024.txt | cut -c1-110
done
left=$(( 570 - ($(date +%s) - T0) ))
timeout $left python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1024,2048 --feature fp8 \
  --only triton_experts --only triton_experts_dual_stream --only experts_oracle -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "runs|pass|FAIL|fail" $L/check_fp8.txt | tail -8
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
