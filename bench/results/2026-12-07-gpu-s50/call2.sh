#!/usr/bin/env bash
# Fiftieth session, call 2: the op level's power in fp32 on the GPU with the twin's scaled B (our one-shot op and
# vLLM 0.33.0's, Qwen3-30B-A3B's layer at 256 and 4113 tokens, ranks 16 and 64), then correct op-level backends on
# random fp32 cases in the time left.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c2; mkdir -p $L
VOP=examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP
# call 1's one failure (triton_one_shot, short sums, K 2: no twin), replayed with its detail, and the eager op beside it
FCASE='{"E":8,"H":2,"I":36,"T":157,"block_size_m":32,"dtype":"float32","layout":"naive","mapping":"skewed","max_loras":4,"max_rank":16,"seed":244586,"shared_a":true,"top_k":1}'
for b in triton_one_shot triton_two_kernel eager; do
  timeout 60 python3 -m moe_lora_harness replay --case "$FCASE" --only $b --device cuda > $L/replay_$b.txt 2>&1
  echo "replay $b rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
done
timeout 60 python3 bench/results/2026-12-07-gpu-s50/dump_case.py "$FCASE" > $L/dump_case.txt 2>&1
echo "dump rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
SOP=examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP
timeout 200 python3 -m moe_lora_harness selftest --power --device cuda --level op --only triton_one_shot -q \
  --model qwen3-30b-a3b --tokens 256,4113 --rank 16,64 --dtype float32 --json $L/op_power_oneshot.json \
  > $L/op_power_oneshot.txt 2>&1; echo "oneshot power rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
timeout 120 python3 -m moe_lora_harness selftest --power --device cuda --level op --backend $VOP --only $VOP -q \
  --model qwen3-30b-a3b --tokens 256 --rank 16 --dtype float32 --json $L/op_power_vllm.json \
  > $L/op_power_vllm.txt 2>&1; echo "vllm power rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $L/log.txt
END=${END:-570}
left() { echo $(( END - ($(date +%s) - T0) )); }
for job in "$SOP op few_rows 64" "$VOP op few_rows 65" "$SOP op served 66" "triton_one_shot op few_rows 67"; do
  set -- $job
  l=$(left); (( l > 25 )) || { echo "$1 $2 $3: no time left" | tee -a $L/validation.txt; continue; }
  t=$(( l < 45 ? l - 5 : 40 ))
  echo "== $1 $2 $3 seed $4 (${t}s)" >> $L/validation.txt
  timeout $(( t + 20 )) python3 bench/validate_correct.py $1 --level $2 --preset $3 --device cuda --seconds $t \
    --seed $4 2>&1 | grep -v "default MoE config" >> $L/validation.txt
  echo "$1 $2 $3 rc=${PIPESTATUS[0]} [$(( $(date +%s) - T0 ))s]" | tee -a $L/validation.txt
done
cut -c1-600 $L/replay_*.txt | head -60; cat $L/dump_case.txt | head -40
grep -v "^(x" $L/op_power_oneshot.txt | cut -c1-200 | tail -40; cut -c1-300 $L/op_power_vllm.txt | tail -14
cut -c1-400 $L/validation.txt
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
