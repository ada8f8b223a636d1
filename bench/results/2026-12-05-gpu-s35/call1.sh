#!/usr/bin/env bash
# session 35, call 1: the GPU lane's tests end to end (the twin run in the judge; the plugin's gpu_alone deselection
# in a parallel CUDA session, first run on a GPU), as the device comes.
set -u
T0=$(date +%s)
L=$OUT/c1; mkdir -p $L
OUT=$L TEST_TIMEOUT=${TEST_TIMEOUT:-330} ALONE_TIMEOUT=${ALONE_TIMEOUT:-150} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-100} \
  bash ci/gpu.sh tests 2>&1 | tail -8 | tee $L/tests_summary.txt
grep -c "gpu_alone\|run them apart" $L/gpu_suites.log | sed 's/^/plugin lines naming gpu_alone: /' | tee -a $L/tests_summary.txt
grep -m2 "run them apart" $L/gpu_suites.log | cut -c1-300 | tee -a $L/tests_summary.txt
echo "c1: $(( $(date +%s) - T0 )) s" | tee -a $L/tests_summary.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
