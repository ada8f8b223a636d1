#!/usr/bin/env bash
# Forty-seventh session, call 2 (the warm H100, the budget's rest): fp32 validation of the backends call 1 had no time
# for (SGLang 0.5.23's op, our one-shot op, the oracle), random fp32 cases of 1-82 long rows where the twin now runs
# (bench/results/2026-12-07-cpu-s47/small_rows_validation.py: served H), then fp32 power at one token.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c2; mkdir -p $L
V=bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py
S=bench/results/2026-12-07-cpu-s47/small_rows_validation.py
for job in "$V examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP op 36" "$V triton_one_shot op 34" \
           "$S triton_experts expert 41" "$S examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert 42" \
           "$S examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op 43" "$S experts_oracle expert 44"; do
  set -- $job
  timeout 55 python3 $1 $2 3000 40 $4 cuda $3 2>&1 | grep -v "default MoE config" >> $L/validation.txt
  echo "$2 $3 [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
timeout $(( 520 - ($(date +%s) - T0) )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
  --tokens 1 --dtype float32 --rank 32 --json $L/power_fp32_T1.json > $L/power_fp32_T1.txt 2>&1
echo "power fp32 T1 rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_fp32_T1.txt | cut -c1-110
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
