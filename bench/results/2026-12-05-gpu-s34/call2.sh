#!/usr/bin/env bash
# session 34, call 2: correct kernels fuzzed at served shapes under rule 4's weighted expert sets (no false verdict:
# issue 30 item 3), our triton_experts, `fuzz --model M --jobs J` (J 16; the memory rule may take fewer); the models
# with many experts first (the weighted sets matter most at top-8), Qwen3-30B-A3B last with what is left.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
C=${C:-c2}; L=$OUT/$C; mkdir -p $L
T0=$(date +%s)
TOTAL=${TOTAL:-560}; J=${J:-16}
BUDGETS=${BUDGETS:-"qwen3-235b-a22b:150 deepseek-v3:80 gpt-oss-120b:60 mixtral-8x22b:50 qwen3-30b-a3b:0"}
for mb in $BUDGETS; do
  m=${mb%%:*}; b=${mb##*:}
  left=$(( TOTAL - ($(date +%s) - T0) ))
  (( left > 70 )) || { echo "$m: no time left"; continue; }
  (( b == 0 || b > left - 40 )) && b=$(( left - 40 ))
  timeout $(( b + 35 )) python3 -m moe_lora_harness fuzz --device cuda --model "$m" --only triton_experts --jobs $J \
    --budget ${b}s -q --no-db --out "$L/served_$m" > "$L/served_$m.txt" 2>&1
  echo "$m: rc $? budget ${b}s $(tail -1 "$L/served_$m.txt" | cut -c1-200)"
done | tee $L/served_summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $L/gpu_env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $L/gpu_env.txt
echo "$C: $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf $C.tgz $C && rm -rf $C
