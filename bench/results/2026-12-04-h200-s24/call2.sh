#!/usr/bin/env bash
# session 24, call 2: memcheck over layer_triton's graph rows (captures, padded and zero-token replays, every dtype;
# ci/sanitize.sh's layer step, issue 31's "nothing may read out of bounds"), its own limit 560 s
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c2; mkdir -p $L
t0=$(date +%s)
SANITIZE_TOOLS=" " SANITIZE_LAYER_TIMEOUT=560 OUT=$L bash ci/sanitize.sh > $L/sanitize_run.txt 2>&1
echo "sanitize rc=$? $(( $(date +%s) - t0 )) s"; cat $L/sanitize_summary.txt; tail -8 $L/sanitize_memcheck_layer.stdout
grep -c "^ *\(pass\|PASS\|ok\)" $L/sanitize_memcheck_layer.stdout; grep -E "ERROR SUMMARY" $L/sanitize_memcheck_layer.log
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
