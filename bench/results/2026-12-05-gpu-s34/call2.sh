#!/usr/bin/env bash
# session 34, call 2: correct kernels fuzzed at served shapes under rule 4's weighted expert sets (no false verdict:
# issue 30 item 3), our triton_experts, `fuzz --model M --jobs 16` (the memory rule may take fewer); the models with
# many experts first (the weighted sets matter most at top-8), Qwen3-30B-A3B last with what is left. What ran was a
# copy of the thirty-third session's call1.sh with these three values as its defaults; it is that script's loop.
C=${C:-c2} TOTAL=${TOTAL:-560} \
BUDGETS=${BUDGETS:-"qwen3-235b-a22b:150 deepseek-v3:80 gpt-oss-120b:60 mixtral-8x22b:50 qwen3-30b-a3b:0"} \
  exec bash "$(dirname "$0")/../2026-12-05-h100-s33/call1.sh"
