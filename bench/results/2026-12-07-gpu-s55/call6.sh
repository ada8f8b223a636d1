#!/usr/bin/env bash
# Fifty-fifth session, call 6: FP8 power at Qwen3-30B-A3B's layer (rank 16, our Triton experts) with 16-token calls
# pooled as check --model pools them since the fifty-fourth session (21 calls, 336 rows: features.DECODE_ROWS 332),
# with rule 4's column blocks; the fifty-third session's 176-row figures (11 calls) are the comparison.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
T0=$(date +%s)
L=$OUT/c6; mkdir -p $L
left() { echo $(( ${END:-580} - ($(date +%s) - T0) )); }
for q in fp8_block fp8_w8a8; do
  (( $(left) > 30 )) || { echo "power $q: no time left" | tee -a $L/skipped.txt; continue; }
  timeout $(left) python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b --quant $q \
    --tokens 16 --calls 21 --dtype bfloat16,float16 --rank 16 --json $L/power_${q}_calls21.json \
    > $L/power_${q}_calls21.txt 2>&1
  echo "power $q calls 21 rc=$? [$(( $(date +%s) - T0 ))s]"
  grep -E "correct kernel|^ +[a-z0-9-]+ +[<=0-9.-]" $L/power_${q}_calls21.txt | cut -c1-110
done
cd $OUT && tar czf c6.tgz c6 && rm -rf c6
