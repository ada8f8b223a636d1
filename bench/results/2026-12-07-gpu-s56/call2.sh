#!/usr/bin/env bash
# Fifty-sixth session, call 2 (an H200): the fifty-fourth session's call 1 as it stands (its logs in $OUT/c1.tgz):
# check --model deepseek-v3's FP8 rows (16 tokens pooled, 100 alone; block and w8a8; fp16 and bf16), estimated at
# 99.4 GiB a case since 5e8bf64 counts the drawn weights (not runnable on an H100, within an H200's 139 GiB), then
# Qwen3-30B-A3B's FP8 rows for the three FP8 expert backends.
set -u
bash "$(dirname "$0")/../2026-12-07-gpu-s54/call1.sh"
