#!/usr/bin/env bash
# session 28, call 2 (as run, carry .thirdparty: the vLLM 0.33.0 and SGLang 0.5.23 wheels unpacked as the examples'
# READMEs say): the two third-party checks never run on CUDA before, vLLM's expert class and SGLang's op
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23
L=$OUT/c2; mkdir -p $L
t=$(date +%s); timeout 135 python3 -m moe_lora_harness check --device cuda --backend examples/vllm_wheel_experts/vllm_wheel_experts.py:VLLM_EXPERTS --only vllm_experts --json $L/check_vllm_experts.json --markdown $L/check_vllm_experts.md > $L/check_vllm_experts.txt 2>&1
echo "vllm_experts rc $? $(( $(date +%s) - t )) s: $(tail -1 $L/check_vllm_experts.txt | cut -c1-200)"
t=$(date +%s); timeout 110 python3 -m moe_lora_harness check --device cuda --backend examples/sglang_wheel_op/sglang_wheel_op.py:SGLANG_OP --only sglang_op --json $L/check_sglang_op.json --markdown $L/check_sglang_op.md > $L/check_sglang_op.txt 2>&1
echo "sglang rc $? $(( $(date +%s) - t )) s: $(tail -1 $L/check_sglang_op.txt | cut -c1-200)"
cd $OUT && tar czf c2.tgz c2
