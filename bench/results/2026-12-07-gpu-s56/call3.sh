#!/usr/bin/env bash
# Fifty-sixth session, call 3: correct kernels fuzzed at served shapes on the current judge (column blocks since the
# fifty-fourth session; the runner's not-runnable out-of-memory since the fifty-fifth): our triton_experts,
# `fuzz --model M --jobs 16` (the memory rule may take fewer), through the thirty-third session's script.
set -u
cd "$(dirname "$0")/../../.."
C=c3 TOTAL=${TOTAL:-400} BUDGETS=${BUDGETS:-"qwen3-30b-a3b:150 gpt-oss-20b:60 mixtral-8x7b:60 qwen3-235b-a22b:0"} \
  bash bench/results/2026-12-05-h100-s33/call1.sh
