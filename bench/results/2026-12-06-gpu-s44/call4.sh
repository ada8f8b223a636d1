#!/usr/bin/env bash
# Forty-fourth session, call 4 (call 3, FP8 power at 2048 and 4113 tokens, found no machine and was not retried: the
# budget left held one call): the lane's tests on the session's final code (the declaration line of a failure,
# runner.UNDECLARED_PASS, besides call 1's judging change).
set -u
cd "$(dirname "$0")/../../.."
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s44final
