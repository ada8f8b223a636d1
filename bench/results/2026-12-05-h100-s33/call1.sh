#!/usr/bin/env bash
# session 33, call 1: correct kernels fuzzed at served shapes (issue 30 item 3: toward 10,000 GPU examples), our
# triton_experts, `fuzz --model M --jobs J`: J (default 16: the host's cores; the memory rule may take fewer) tried
# after 8 gave 5.1 examples/s; each model's budget from BUDGETS, Qwen3-235B-A22B last with what is left.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
C=${C:-c1}; L=$OUT/$C; mkdir -p $L
T0=$(date +%s)
TOTAL=${TOTAL:-540}; J=${J:-16}
BUDGETS=${BUDGETS:-"qwen3-30b-a3b:230 gpt-oss-20b:60 mixtral-8x7b:50 nemotron-3-nano-30b-a3b:60 qwen3-235b-a22b:0"}
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
