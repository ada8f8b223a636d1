#!/usr/bin/env bash
# session 36, call 4: the GPU lane's tests on this session's final code (selftest --power's FP8 limit label and its
# start notice; call 1 ran the rest of it). Not run: the device refused (README).
bash ci/gpu_call_tests.sh c4
