#!/usr/bin/env bash
# Fifty-first session, call 3 (the budget's rest, under 300 s): after the lane, the diagnosis says a matched model's
# usual cause (diagnose.CAUSES); the replay of call 1 and the diagnosis and one-shot smoke suites on this GPU again.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c3; mkdir -p $L
timeout 90 python3 bench/onto_output_replay.py --device cuda --as-before 2>&1 | grep -v "default MoE config" > $L/replay.txt
grep "precision:" $L/replay.txt | cut -c1-700
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 src/moe_lora_harness/suites/harness/test_diagnose.py \
  src/moe_lora_harness/suites/kernels/test_triton_lora_op_smoke.py --moe-lora-device cuda 2>&1 | tail -3 | tee $L/tests.txt
