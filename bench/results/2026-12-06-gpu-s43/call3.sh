#!/usr/bin/env bash
# Forty-third session, call 3 (call 2 never found a machine; this one holds it): the lane's tests on the final code
# (`ci/gpu_call_tests.sh`: its CUDA suites run the FP8 landing rows, whose 161-token rows now run the twin with its own
# emulation), then FP8 power at Qwen3-30B-A3B's layer with 1024 tokens (row tile 64, the truncating MMA emulated: rule 4
# was off there in the forty-second session) and check --model's FP8 rows at 1024 and 2048 tokens, in what time is left.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
TEST_TIMEOUT=300 ALONE_TIMEOUT=120 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s43lane
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( 585 - ($(date +%s) - T0) )); }
for q in fp8_w8a8 fp8_block; do
  timeout $(( $(left) < 105 ? $(left) : 105 )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 1024 --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T1024.json > $L/power_${q}_T1024.txt 2>&1
  echo "power $q rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T1024.txt | cut -c1-100
done
timeout $(left) python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1024,2048 --feature fp8 \
  --only triton_experts --only triton_experts_dual_stream --only experts_oracle -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "runs|pass|FAIL|fail" $L/check_fp8.txt | tail -8
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
