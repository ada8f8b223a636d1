#!/usr/bin/env bash
# Fifty-fourth session, call 3 (the device budget nearly spent on refused starts): the GPU lane alone on this
# session's judge (rule 4's column blocks, per-element FP8 flip squares, decode rows pooled to 332).
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,memory.total --format=csv
TEST_TIMEOUT=${TEST_TIMEOUT:-280} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s54lane
