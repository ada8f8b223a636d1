#!/usr/bin/env bash
# Forty-fifth session, call 3: the lane's tests on the session's final judging code (the op-level twin; the
# forty-fourth session's review mend, which had not run on a GPU).
set -u
cd "$(dirname "$0")/../../.."
TEST_TIMEOUT=280 ALONE_TIMEOUT=110 CPU_FULL_TIMEOUT=90 bash ci/gpu_call_tests.sh s45lane
