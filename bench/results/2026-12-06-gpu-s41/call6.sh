#!/usr/bin/env bash
# session 41, call 6 (calls 2-5 never got a machine; the device budget left ~270 s): the landing tests alone: our FP8
# experts against both emulations in both row-tile regimes, and the runner's verdict with the declared accumulation.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c6; mkdir -p $L
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -p no:xdist --moe-lora-device cuda \
  src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on" > $L/landing.log 2>&1
echo "landing rc $?"; grep -E "elements off|passed|failed|Error" $L/landing.log | cut -c1-220
