#!/usr/bin/env bash
# session 36, call 1: the GPU lane's tests on the code the last session left (its review mends to the runner and
# two CPU-side test edits had not run on a GPU).
set -u
T0=$(date +%s)
L=$OUT/c1; mkdir -p $L
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} ALONE_TIMEOUT=${ALONE_TIMEOUT:-150} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-100} \
  bash ci/gpu.sh tests 2>&1 | tail -8 | tee $L/tests_summary.txt
echo "c1: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
