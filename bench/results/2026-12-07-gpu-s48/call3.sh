#!/usr/bin/env bash
# Forty-eighth session, what the last 314 s of device budget allow: the CPU judge's fingerprints under this machine's
# torch, then the suites this session's changes touch (the twin's views and rules, underflow, the judge on the GPU,
# the twin runs) on CUDA. Not the lane: thirteen starts found no machine.
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/golden && cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/before.json
PYTHONPATH=$PWD/src timeout 60 python3 -m moe_lora_harness.suites.harness.judge_golden --record > /dev/null 2>&1
echo "golden rc=$? [$(( $(date +%s) - T0 ))s]"
cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/after.json
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
S=src/moe_lora_harness/suites
MOE_LORA_HARNESS_MAX_EXAMPLES=3 timeout ${TEST_TIMEOUT:-140} python3 -m pytest -q -p no:benchmark -p no:cacheprovider \
  -n 12 --moe-lora-device cuda $S/harness/test_twin_run.py $S/harness/test_underflow.py $S/harness/test_properties.py \
  $S/harness/test_judge_on_gpu.py $S/harness/test_twin_floor.py $S/reference/test_activations.py \
  > $OUT/touched_suites.log 2>&1
echo "touched suites rc=$? [$(( $(date +%s) - T0 ))s]"; tail -3 $OUT/touched_suites.log
