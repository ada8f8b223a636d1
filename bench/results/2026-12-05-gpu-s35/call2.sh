#!/usr/bin/env bash
# session 35, call 2: fp32 with the twin run at served shapes. The twins' q (bench/acc_share_study.py: their squared
# difference over twice the kernel's excess; the allowance covers the accumulation while 2 q TWIN_FACTOR >= 1) for
# our Triton experts and eager (cuBLAS); the power rows fp32 (Qwen3-30B-A3B ranks 16/32 at 256 and 4113 tokens,
# Qwen3-235B-A22B at 256); check --model's fp32 rows (correct kernels, twin judged) for four models.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c2; mkdir -p $L
T0=$(date +%s)
left() { echo $(( ${TOTAL:-560} - ($(date +%s) - T0) )); }
timeout 90 python3 bench/acc_share_study.py --device cuda --backend triton_experts,eager --model qwen3-30b-a3b \
  --tokens 256,4113 --json $L/acc_share_cuda.json > $L/acc_share_cuda.txt 2>&1; echo "acc_share rc $? [$(( $(date +%s) - T0 ))s]"
timeout 200 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --tokens 256,4096+17 \
  --dtype float32 --rank 16,32 --json $L/power_fp32_q30.json > $L/power_fp32_q30.txt 2>&1
echo "power q30 fp32 rc $? [$(( $(date +%s) - T0 ))s]"
for m in qwen3-30b-a3b mixtral-8x7b gpt-oss-20b nemotron-3-nano-30b-a3b; do
  l=$(left); (( l > 30 )) || { echo "check $m: no time left"; continue; }
  timeout $(( l < 70 ? l : 70 )) python3 -m moe_lora_harness check --device cuda --model $m --only triton_experts \
    --tokens 256,4096+17 --feature "experts: fp32" --json $L/check_fp32_$m.json > $L/check_fp32_$m.txt 2>&1
  echo "check fp32 $m rc $?: $(tail -1 $L/check_fp32_$m.txt | cut -c1-160) [$(( $(date +%s) - T0 ))s]"
done
l=$(left); if (( l > 60 )); then
  timeout $l python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-235b-a22b --tokens 256 \
    --dtype float32 --json $L/power_fp32_q235.json > $L/power_fp32_q235.txt 2>&1
  echo "power q235 fp32 rc $? [$(( $(date +%s) - T0 ))s]"
fi
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
