#!/usr/bin/env bash
# session 41, call 1: the declared e4m3 MMA on the GPU: our FP8 experts against the MMA's emulation (tests), the
# emulation's throughput, the FP8 power rows with the statistical accumulation term, check --model's FP8 rows.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
L=$OUT/c1; mkdir -p $L
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader > $L/gpu_env.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $L/gpu_env.txt
timeout 150 python3 -m pytest -q -s -p no:cacheprovider src/moe_lora_harness/suites/experts/test_fp8.py -k "land_on or declared_mma or statistical_accumulation" \
  src/moe_lora_harness/suites/reference/test_fp8_mma.py > $L/tests.txt 2>&1
echo "tests rc $? [$(( $(date +%s) - T0 ))s]"; grep -E "off the MMA|passed|failed|Error" $L/tests.txt | tail -20
timeout 90 python3 - > $L/throughput.txt 2>&1 <<'PY'
import time, torch
from moe_lora_harness.reference.fp8 import quantize_activation, quantize_weights
from moe_lora_harness.reference.fp8_mma import scaled_gemm
for scheme in ("fp8_w8a8", "fp8_block"):
    for M, N, K in ((256, 1536, 2048), (2048, 1536, 2048)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, s = quantize_activation(torch.randn(M, K, device="cuda", dtype=torch.float64, generator=g), scheme)
        codes, scales = quantize_weights(torch.randn(1, N, K, device="cuda", generator=g).to(torch.bfloat16), scheme)
        xs = s[:, :1] if scheme == "fp8_w8a8" else s[:, ::128]
        w, ws = codes[0].to(torch.float64), scales[0].to(torch.float64)
        scaled_gemm(q[:8], xs[:8], w, ws, scheme, 128); torch.cuda.synchronize()
        t = time.time(); scaled_gemm(q, xs, w, ws, scheme, 128); torch.cuda.synchronize(); dt = time.time() - t
        print(f"{scheme} M={M} N={N} K={K}: {dt:.3f} s, {M*N*K/dt:.3g} products/s", flush=True)
PY
echo "throughput rc $? [$(( $(date +%s) - T0 ))s]"; cat $L/throughput.txt | tail -6
for q in fp8_w8a8 fp8_block; do
  timeout 200 python3 -m moe_lora_harness selftest --power --device cuda --model qwen3-30b-a3b \
    --quant $q --tokens 16,256 --dtype bfloat16,float16 --rank 16 --json $L/power_$q.json > $L/power_$q.txt 2>&1
  echo "power $q rc $? [$(( $(date +%s) - T0 ))s]"
  grep -v WARN $L/power_$q.txt | tail -32
done
timeout 120 python3 -m moe_lora_harness check --device cuda --model qwen3-30b-a3b --tokens 1,7,64,256 --feature fp8 \
  --only triton_experts --only triton_experts_dual_stream --only experts_oracle --only eager -q --json $L/check_fp8.json > $L/check_fp8.txt 2>&1
echo "check rc $? [$(( $(date +%s) - T0 ))s]"; tail -25 $L/check_fp8.txt
cd $OUT && tar czf c1.tgz c1 && rm -rf c1
