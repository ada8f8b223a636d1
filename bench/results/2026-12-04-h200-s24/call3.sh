#!/usr/bin/env bash
# session 24, call 3 (issue 30, "no false verdict anywhere"): first the served fuzz of the three models call 1 could
# not test with --jobs 8 (now `fuzz --model` runs as many jobs as the device holds at the layer), then `check --model`
# for every catalogued model in every dtype the profile takes (bf16, fp16, fp32) at decode and prefill (1 and 4113
# tokens), judge on the GPU, our triton_experts, the row "experts: tokens without adapter (-1)" (LoRA on, some
# tokens mapped to no adapter); stops starting models after 330 s
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c3; mkdir -p $L
t0=$(date +%s)
SERVED_MODELS="deepseek-v3 mixtral-8x22b gpt-oss-120b" SERVED_BUDGET=15s OUT=$L timeout 150 bash ci/gpu.sh served 2>&1 | tail -4
grep -h "\[fuzz\]" $L/served_*.txt | head -5
echo "served: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
for m in $(python3 -c "from moe_lora_harness.harness.served.models import MODELS; print(' '.join(m.name for m in MODELS))"); do
  s0=$(date +%s)
  timeout 75 python3 -m moe_lora_harness check --device cuda --model "$m" --only triton_experts --tokens 1,4096+17 \
    --feature "experts: tokens without adapter" --json "$L/check_model_$m.json" > "$L/check_model_$m.txt" 2>&1
  echo "$m: rc=$? $(tail -1 "$L/check_model_$m.txt" | cut -c1-150) [$(( $(date +%s) - s0 ))s]"
  [[ $(( $(date +%s) - t1 )) -gt 330 ]] && { echo "stopped: time"; break; }
done | tee $L/summary.txt
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
