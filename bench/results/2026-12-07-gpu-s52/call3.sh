#!/usr/bin/env bash
# Fifty-third session, call 3 (the machine warm after call 2): no false verdict from pooled FP8 decode calls on the
# GPU: bench/validate_correct.py's fp8_decode level (calls of 1-16 tokens pooled to 83-200 rows, both schemes,
# fp16/bf16, four activations) for our Triton experts and their dual-stream form, 200 s each.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1; mkdir -p $OUT/c3
for b in triton_experts triton_experts_dual_stream; do
  timeout 250 python3 bench/validate_correct.py $b --level fp8_decode --device cuda --seconds 200 --seed 53 \
    > $OUT/c3/validate_fp8_decode_$b.txt 2>&1
  echo "$b rc=$?"; tail -8 $OUT/c3/validate_fp8_decode_$b.txt | cut -c1-250
done
