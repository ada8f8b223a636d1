#!/usr/bin/env bash
# Forty-eighth session, the one GPU call the budget left after eleven starts found no machine: the CPU judge's
# fingerprints recorded under this machine's torch, then the lane's CUDA suites and its gpu_alone tests (ci/gpu.sh
# tests' first two phases, the same commands); its CPU full tier did not fit (CPU CI runs the gate tier of it).
set -u
cd "$(dirname "$0")/../../.."
T0=$(date +%s)
mkdir -p $OUT/golden && cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/before.json
PYTHONPATH=$PWD/src timeout 90 python3 -m moe_lora_harness.suites.harness.judge_golden --record > /dev/null 2>&1
echo "golden rc=$? [$(( $(date +%s) - T0 ))s]"
cp src/moe_lora_harness/suites/harness/judge_golden_builds.json $OUT/golden/after.json
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/lane; mkdir -p $L
MOE_LORA_HARNESS_MAX_EXAMPLES=3 timeout ${TEST_TIMEOUT:-230} \
  python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 12 --moe-lora-device cuda \
  --deselect src/moe_lora_harness/suites/test_one_name.py::test_static_tools_resolve_every_import_of_the_repository \
  --moe-lora-cases-per-feature 1 --durations=12 --junitxml="$L/gpu_suites.junit.xml" > "$L/gpu_suites.log" 2>&1
echo "gpu suites rc=$? [$(( $(date +%s) - T0 ))s]"; tail -3 "$L/gpu_suites.log"
timeout ${ALONE_TIMEOUT:-75} python3 -m pytest -q -p no:benchmark -p no:cacheprovider -p no:xdist \
  --moe-lora-device cuda -m gpu_alone --durations=4 --junitxml="$L/gpu_alone.junit.xml" \
  src/moe_lora_harness/suites > "$L/gpu_alone.log" 2>&1
echo "gpu alone rc=$? [$(( $(date +%s) - T0 ))s]"; tail -1 "$L/gpu_alone.log"
cd $OUT && tar czf lane.tgz lane && rm -rf lane
