#!/usr/bin/env bash
# session 23, call 1 (issue 32's record): the lane's tests, selftest --quick on CUDA, the layer fuzz throughput
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/lane; mkdir -p $L
t0=$(date +%s)
TEST_TIMEOUT=330 CPU_FULL_TIMEOUT=120 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -8
echo "lane tests: $(( $(date +%s) - t0 )) s"
(cd $OUT && tar czf lane.tgz lane && rm -rf lane); L=$OUT
t1=$(date +%s)
( time timeout 200 python3 -m moe_lora_harness selftest --quick --device cuda --json $L/selftest_quick_cuda.json \
    --junit $L/selftest_quick_cuda.junit.xml ) > $L/selftest_quick_cuda.txt 2>&1
echo "selftest rc=$? $(( $(date +%s) - t1 )) s"; tail -25 $L/selftest_quick_cuda.txt
t2=$(date +%s)
timeout 110 python3 bench/bench_fuzz.py --level layer --only layer_triton --device cuda --budget 60 --out $L/layer_fuzz > $L/layer_fuzz.txt 2>&1
echo "layer fuzz rc=$? $(( $(date +%s) - t2 )) s"; tail -6 $L/layer_fuzz.txt
cd $OUT && tar czf layer_fuzz.tgz layer_fuzz layer_fuzz.txt && rm -rf layer_fuzz layer_fuzz.txt
