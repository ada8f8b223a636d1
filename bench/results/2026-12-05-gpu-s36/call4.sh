#!/usr/bin/env bash
# session 36, call 4: the GPU lane's tests on this session's final code (selftest --power's FP8 limit label and its
# start notice; call 1 ran the rest of it).
set -u
T0=$(date +%s)
L=$OUT/c4; mkdir -p $L
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} ALONE_TIMEOUT=${ALONE_TIMEOUT:-150} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-100} \
  bash ci/gpu.sh tests 2>&1 | tail -8 | tee $L/tests_summary.txt
echo "c4: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
cd $OUT && tar czf c4.tgz c4 && rm -rf c4
