#!/usr/bin/env bash
# Forty-sixth session, call A (rule 3 with the twin; the twin under TP and dispatched EP): correct backends on random
# fp32 cases through the runner on the GPU (bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py; served sizes
# too), ours and vLLM 0.33.0's and SGLang 0.5.23's (their files carried in .thirdparty, kept out of the repository);
# then fp32 power at Qwen3-30B-A3B's layer, 256 tokens, rank 32, in the time left. vLLM's expert classes need every
# .py of its wheel in .thirdparty: unzip -q vllm-0.33.0-*.whl 'vllm/*.py' 'vllm/model_executor/layers/fused_moe/configs/*'
# -d .thirdparty/vllm-0.33.0 (58 MB, within carry's 64 MiB with SGLang's one file).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
T0=$(date +%s)
L=$OUT/cA; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( 570 - ($(date +%s) - T0) )); }
V=bench/results/2026-12-06-cpu-s46/twin_rule3_validation.py
for job in "triton_experts expert" "experts_oracle expert" "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS expert" \
           "triton_one_shot op" "triton_two_kernel op" "examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP op" \
           "examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP op"; do
  set -- $job
  timeout 75 python3 $V $1 3000 40 31 cuda $2 >> $L/validation.txt 2>&1
  echo "$1 $2 rc=$? [$(( $(date +%s) - T0 ))s]"
done
cut -c1-400 $L/validation.txt
if [ $(left) -gt 60 ]; then
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --tokens 256 \
    --dtype float32 --rank 32 --json $L/power_fp32_T256.json > $L/power_fp32_T256.txt 2>&1
  echo "power fp32 rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_fp32_T256.txt | cut -c1-110
fi
cd $OUT && tar czf cA.tgz cA && rm -rf cA
