#!/usr/bin/env bash
# One device call of the GPU lane's tests (`ci/gpu.sh tests`) with limits that fit one 10-minute call, its logs
# tarred as $OUT/NAME.tgz (the device returns few files): the call every session's lane check makes.
#   usage (on the device, $OUT set by it): bash ci/gpu_call_tests.sh NAME
set -u
NAME=${1:?usage: bash ci/gpu_call_tests.sh NAME}
T0=$(date +%s)
L=$OUT/$NAME; mkdir -p "$L"
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} ALONE_TIMEOUT=${ALONE_TIMEOUT:-150} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-100} \
  bash ci/gpu.sh tests 2>&1 | tail -8 | tee "$L/tests_summary.txt"
echo "$NAME: $(( $(date +%s) - T0 )) s" | tee -a "$L/tests_summary.txt"
cd "$OUT" && tar czf "$NAME.tgz" "$NAME" && rm -rf "$NAME"
