#!/usr/bin/env bash
# session 23, call 3: memcheck over layer_triton's named rows (ci/sanitize.sh's new step; issue 31's "nothing may
# read out of bounds"), then the lane's tests on the session's final judge code
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c3; mkdir -p $L
t0=$(date +%s)
SANITIZE_TOOLS=" " SANITIZE_TIMEOUT=220 OUT=$L bash ci/sanitize.sh > $L/sanitize_run.txt 2>&1
echo "sanitize rc=$? $(( $(date +%s) - t0 )) s"; cat $L/sanitize_summary.txt; tail -5 $L/sanitize_memcheck_layer.stdout
t1=$(date +%s)
TEST_TIMEOUT=300 CPU_FULL_TIMEOUT=100 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -4
echo "lane tests: $(( $(date +%s) - t1 )) s"
cd $OUT && tar czf c3.tgz c3 && rm -rf c3
