#!/usr/bin/env bash
# session 28, call 1: the GPU lane's tests (`ci/gpu.sh tests`) on the code of issue 34's move and the twenty-seventh
# session's judge changes (the Rules shared by verdict and diagnoses, the FP8 CPU term): the run issue 34 waits for.
# Then, in the time the call has left (device starts were scarce this session): the judge at DeepSeek-V3, 16384
# tokens, under torch.profiler (issue 30 item 4: where its 47 s go), and the FP8 floor probe at Qwen3-30B-A3B.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
L=$OUT/c1; mkdir -p $L
T0=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - T0) )); }
TEST_TIMEOUT=400 CPU_FULL_TIMEOUT=150 OUT=$L bash ci/gpu.sh tests 2>&1 | tail -6
echo "lane tests: $(( $(date +%s) - T0 )) s"
grep -E "^FAILED|^ERROR" $L/gpu_suites.log $L/cpu_full_tier.log | head -20
if (( $(left) > 100 )); then
  t=$(date +%s)
  timeout $(( $(left) > 150 ? 150 : $(left) - 10 )) python3 bench/bench_judge.py --device cuda --models deepseek-v3 \
    --tokens 16384 --repeats 1 --out $L --profile $L/judge_profile.txt > $L/bench_judge.txt 2>&1
  echo "judge profile: rc $?, $(( $(date +%s) - t )) s"; tail -3 $L/bench_judge.txt | cut -c1-200
fi
if (( $(left) > 60 )); then
  t=$(date +%s)
  timeout $(( $(left) - 10 )) python3 bench/probe_fp8_floor.py --device cuda --model qwen3-30b-a3b --tokens 16,256 \
    --out $L/probe_fp8_floor.json > $L/probe_fp8_floor.txt 2>&1
  echo "fp8 floor probe: rc $?, $(( $(date +%s) - t )) s"
fi
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
