#!/usr/bin/env bash
# session 36, call 3: the FP8 rows' power measured on a GPU for the first time (our triton_experts, whose e4m3 MMA
# keeps the worst-case accumulation term in the floor); until now the GPU figure (2-33) was the CPU table's before
# the CPU's statistical term. Qwen3-30B-A3B's layer, 16 and 256 tokens, bf16 and fp16, rank 16; w8a8 then block.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
T0=$(date +%s)
for q in fp8_w8a8 fp8_block; do
  timeout ${ROW_TIMEOUT:-270} python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc $? [$(( $(date +%s) - T0 ))s]"
  grep -v WARN $L/power_$q.txt | tail -40
done
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
