#!/usr/bin/env bash
# Fifty-fourth session, call 4 (under 320 s of device time left): the GPU suites this session's change touches, on
# CUDA as the lane runs them: the FP8 suite (per-element flip squares, the twin-capped infinite flips under the
# truncating MMA), rule 4's statistical tests, the decode calls and the judge on the GPU.
set -u
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD/src
mkdir -p $OUT/c4
nvidia-smi --query-gpu=name --format=csv,noheader
MOE_LORA_HARNESS_MAX_EXAMPLES=3 timeout ${T:-200} python3 -m pytest -q -p no:benchmark -p no:cacheprovider -n 12 --moe-lora-device cuda -rfE \
  src/moe_lora_harness/suites/experts/test_fp8.py src/moe_lora_harness/suites/harness/test_statistical_model.py \
  src/moe_lora_harness/suites/harness/test_decode_calls.py src/moe_lora_harness/suites/harness/test_judge_on_gpu.py \
  > $OUT/c4/pytest.txt 2>&1
echo "rc $?"; tail -n 15 $OUT/c4/pytest.txt
