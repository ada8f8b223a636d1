#!/usr/bin/env bash
# session 28, call 3 (as run, carry .thirdparty): fuzz --jobs 8 over vLLM's expert class and SGLang's op (40 s each),
# then the served search at Qwen3-30B-A3B over our triton_experts (40 s)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c3; mkdir -p $L
for b in "examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS vllm_experts" "examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP sglang_op"; do
  read -r ref name <<< "$b"; t=$(date +%s)
  timeout 70 python3 -m moe_lora_harness fuzz --device cuda --backend $ref --only $name --jobs 8 --budget 40s -q --no-db --out $L/fuzz_$name > $L/fuzz_$name.txt 2>&1
  echo "fuzz $name rc $? $(( $(date +%s) - t )) s: $(grep -E "examples" $L/fuzz_$name.txt | tail -1 | cut -c1-220)"
done
t=$(date +%s); timeout 70 python3 -m moe_lora_harness fuzz --device cuda --model qwen3-30b-a3b --only triton_experts --jobs 8 --budget 40s -q --no-db --out $L/served_qwen3-30b-a3b > $L/served_qwen3.txt 2>&1
echo "served qwen3-30b rc $? $(( $(date +%s) - t )) s: $(tail -1 $L/served_qwen3.txt | cut -c1-200)"
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
