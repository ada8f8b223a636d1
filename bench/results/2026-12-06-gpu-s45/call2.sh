#!/usr/bin/env bash
# Forty-fifth session, call 2 (the op-level twin): correct op backends on random fp32 op cases through the runner, the
# twin on those of 83 rows or more (bench/results/2026-12-06-cpu-s45/op_twin_validation.py): our Triton ops and
# vLLM 0.33.0's and SGLang 0.5.23's ops (their files carried in .thirdparty, kept out of the repository); then, in the
# time left, call 1's FP8 power at 2048 tokens (it found no machine).
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
T0=$(date +%s)
L=$OUT/c2; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
left() { echo $(( 575 - ($(date +%s) - T0) )); }
V=bench/results/2026-12-06-cpu-s45/op_twin_validation.py
for b in triton_one_shot triton_one_shot_split_k triton_one_shot_stream triton_two_kernel triton_small_batch \
         examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP; do
  timeout 70 python3 $V $b 2000 45 7 cuda >> $L/op_twin_validation.txt 2>&1
  echo "$b rc=$? [$(( $(date +%s) - T0 ))s]"
done
cat $L/op_twin_validation.txt | cut -c1-300
for q in fp8_w8a8 fp8_block; do
  [ $(left) -lt 40 ] && break
  timeout $(( $(left) < 140 ? $(left) : 140 )) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 2048 --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_T2048.json > $L/power_${q}_T2048.txt 2>&1
  echo "power $q T2048 rc=$? [$(( $(date +%s) - T0 ))s]"; grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_T2048.txt | cut -c1-100
done
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
