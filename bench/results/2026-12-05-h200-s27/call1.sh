#!/usr/bin/env bash
# session 27, call 1: the GPU lane's tests on this session's code (harness/ in rooms, the verdict's Rules shared with
# the diagnoses, the FP8 CPU term), then the FP8 floor probe at Qwen3-30B-A3B (the GPU's e4m3 MMA against each floor
# term, the CPU's statistical one included)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c1; mkdir -p $L
t0=$(date +%s)
TEST_TIMEOUT=290 CPU_FULL_TIMEOUT=90 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -6
echo "lane tests: $(( $(date +%s) - t0 )) s"
grep -E "^FAILED|^ERROR" $L/gpu_suites.log $L/cpu_full_tier.log | head -20
t1=$(date +%s)
timeout 130 python3 bench/probe_fp8_floor.py --device cuda --model qwen3-30b-a3b --tokens 16,256 \
  --out $L/probe_fp8_floor.json > $L/probe_fp8_floor.txt 2>&1
echo "fp8 floor probe: $(( $(date +%s) - t1 )) s, rc $?"
python3 - "$L/probe_fp8_floor.json" <<'PY' || tail -3 $L/probe_fp8_floor.txt | cut -c1-400
import json, sys
for r in json.load(open(sys.argv[1])):
    c = json.loads(r["case"]); q = r["kernel_vs_emulation_over"]
    print(c["T"], c["dtype"], c["quant"], {k: [round(x, 4) for x in v] for k, v in q.items()})
PY
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
