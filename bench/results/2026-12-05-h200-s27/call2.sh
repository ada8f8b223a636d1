#!/usr/bin/env bash
# session 27, call 2: third parties on CUDA (vLLM 0.33.0's op and expert class, SGLang 0.5.23's op, from their
# wheels carried in .thirdparty: check, check --model at Qwen3-235B-A22B, fuzz --jobs 8 beside our op)
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c2; mkdir -p $L
t0=$(date +%s)
VLLM_SOURCE=$PWD/.thirdparty/vllm-0.33.0 SGLANG_SOURCE=$PWD/.thirdparty/sglang-0.5.23 \
  THIRDPARTY_MODELS=qwen3-235b-a22b THIRDPARTY_MODEL_BUDGET=45s OUT=$L timeout 540 bash ci/gpu.sh thirdparty 2>&1 | tail -12
echo "thirdparty: $(( $(date +%s) - t0 )) s"
grep -h -E "^FAIL|distinct failure" $L/*.txt | cut -c1-200 | head -20
cd $OUT && tar czf c2.tgz c2 && rm -rf c2
