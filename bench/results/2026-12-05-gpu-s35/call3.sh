#!/usr/bin/env bash
# session 35, call 3: the GPU lane's tests again after the reordered view's fix (swigluoai's interleaved w13 rows)
# and the twin test's new claim; as the device comes.
set -u
T0=$(date +%s)
L=$OUT/c3; mkdir -p $L
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} ALONE_TIMEOUT=${ALONE_TIMEOUT:-150} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-100} \
  bash ci/gpu.sh tests 2>&1 | tail -8 | tee $L/tests_summary.txt
echo "c3: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
