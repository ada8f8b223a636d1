#!/usr/bin/env bash
# session 24, call 1: the GPU lane's tests on the final code (the declaration test's fixed form had not run on the
# GPU), then the served fuzz (`ci/gpu.sh served`: correct triton_experts at every catalogued model's shapes, issue 30)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c1; mkdir -p $L
t0=$(date +%s)
TEST_TIMEOUT=300 CPU_FULL_TIMEOUT=100 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -6
echo "lane tests: $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
SERVED_BUDGET=12s timeout 200 env OUT=$L bash ci/gpu.sh served 2>&1 | tail -10
echo "served: $(( $(date +%s) - t1 )) s"
grep -h -E "examples|failures|FAIL" $L/served_*.txt | tail -20
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
