#!/usr/bin/env bash
# Fifty-sixth session, call 1: the GPU lane on the fifty-fifth session's runner (a harness-side out-of-memory while
# drawing inputs is not-runnable, in the worker and in the EP rank processes).
set -u
cd "$(dirname "$0")/../../.."
nvidia-smi --query-gpu=name,memory.total --format=csv
TEST_TIMEOUT=${TEST_TIMEOUT:-290} ALONE_TIMEOUT=${ALONE_TIMEOUT:-110} CPU_FULL_TIMEOUT=${CPU_FULL_TIMEOUT:-90} \
  bash ci/gpu_call_tests.sh s56lane
