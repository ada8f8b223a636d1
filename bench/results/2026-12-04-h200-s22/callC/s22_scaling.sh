#!/usr/bin/env bash
# session 22 scratch: fuzz --jobs 8 over vLLM's op, the code before (bench/scratch/old: b5cb879) and after the CPU draw
set -u
export PYTHONUNBUFFERED=1 VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0
R=$OUT/scaling; mkdir -p $R
f() {  # name src jobs budget backend-name
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 > $R/util_$1.txt 2>/dev/null &
  sp=$!
  extra=(); [[ $5 == vllm_op ]] && extra=(--backend examples/vllm_wheel_op/vllm_wheel_op.py:VLLM_OP)
  ( time PYTHONPATH=$2 timeout 150 python3 -m moe_lora_harness fuzz --device cuda "${extra[@]}" --only $5 \
      --jobs $3 --budget $4 -q --no-db --out $R/fuzz_$1 ) > $R/fuzz_$1.txt 2>&1
  kill $sp
  echo "$1 [$2] jobs=$3: $(grep -E 'examples' $R/fuzz_$1.txt | tail -1 | cut -c1-150) | util mean $(awk '{s+=$1;n++} END {printf "%.0f%% of %d samples", s/n, n}' $R/util_$1.txt) | $(grep real $R/fuzz_$1.txt)"
}
NEW=$PWD/src OLD=$PWD/bench/scratch/old/src
f warm $NEW 8 25s vllm_op
f old8 $OLD 8 60s vllm_op
f new8 $NEW 8 60s vllm_op
f new1 $NEW 1 40s vllm_op
f tri8 $NEW 8 60s triton
cd $OUT && tar czf scaling.tgz scaling && rm -rf scaling
