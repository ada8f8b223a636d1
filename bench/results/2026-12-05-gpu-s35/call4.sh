#!/usr/bin/env bash
# session 35, call 4: correct kernels judged with the twin at served shapes: check --model's fp32 row for every
# catalogued model (256 and 4113 tokens; DeepSeek-V3 at 256 alone: its fp32 layer is 45 GB), then served fuzz of
# triton_experts (dtype drawn, fp32 among them) at GPT-OSS-20B (interleaved swigluoai) and Qwen3-30B-A3B.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c4; mkdir -p $L
T0=$(date +%s)
left() { echo $(( ${TOTAL:-560} - ($(date +%s) - T0) )); }
while read -r m tok lim; do
  l=$(left); (( l > 25 )) || { echo "check $m: no time left"; continue; }
  timeout $(( l < lim ? l : lim )) python3 -m moe_lora_harness check --device cuda --model $m --only triton_experts \
    --tokens $tok --feature "experts: fp32" --json $L/check_fp32_$m.json > $L/check_fp32_$m.txt 2>&1
  echo "check fp32 $m rc $?: $(tail -1 $L/check_fp32_$m.txt | cut -c1-160) [$(( $(date +%s) - T0 ))s]"
done <<'ROWS'
gpt-oss-20b 256,4096+17 150
gpt-oss-120b 256 60
qwen3-235b-a22b 256,4096+17 70
mixtral-8x22b 256 60
nemotron-3-nano-30b-a3b 256,4096+17 40
deepseek-v3 256 70
ROWS
for m in gpt-oss-20b qwen3-30b-a3b; do
  l=$(left); (( l > 120 )) || { echo "fuzz $m: no time left"; continue; }
  b=45; [[ $m == qwen3-30b-a3b ]] && b=$(( l - 100 ))
  timeout $(( b + 90 )) python3 -m moe_lora_harness fuzz --device cuda --model $m --only triton_experts --jobs 8 \
    --budget ${b}s -q --no-db --out $L/fuzz_$m > $L/fuzz_$m.txt 2>&1
  echo "fuzz $m (${b}s) rc $?: $(tail -1 $L/fuzz_$m.txt | cut -c1-200) [$(( $(date +%s) - T0 ))s]"
done
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
