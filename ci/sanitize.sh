#!/usr/bin/env bash
# A small dual-stream expert forward (Triton experts, LoRA deltas on the aux stream) under NVIDIA
# compute-sanitizer: racecheck (shared-memory hazards inside our kernels) and synccheck (invalid
# barrier use). GPU only; run on the H200 by the lead. Cross-stream ordering itself is checked by the
# Recorder (suites/schedule) and by the sleep-injection stress test (suites/schedule/test_gpu_stress.py).
#
# Fails when a tool reports an error, AND when a tool did not really run: the sanitizer binary is
# missing, its log lacks the "ERROR SUMMARY" line, or the program did not print its completion marker.
#   usage: OUT=dir bash ci/sanitize.sh            (logs: $OUT/sanitize_<tool>.log and .stdout)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export PYTORCH_NO_CUDA_MEMORY_CACHING=1     # every buffer is its own allocation: out-of-range use cannot hide
PY=${PYTHON:-python3}
MARKER="DUAL_STREAM_SANITIZE_FORWARD_DONE"

find_sanitizer() {
  if [[ -n ${COMPUTE_SANITIZER:-} && -x ${COMPUTE_SANITIZER} ]]; then echo "$COMPUTE_SANITIZER"; return; fi
  if command -v compute-sanitizer >/dev/null 2>&1; then command -v compute-sanitizer; return; fi
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
           /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    [[ -x $c ]] && { echo "$c"; return; }
  done
}
SAN=$(find_sanitizer)
if [[ -z $SAN ]]; then
  echo "FAIL: compute-sanitizer not found (set COMPUTE_SANITIZER=/path/to/compute-sanitizer)" | tee "$OUT/sanitize_summary.txt"
  exit 1
fi
"$SAN" --version > "$OUT/sanitize_version.txt" 2>&1 || true

PROGRAM=$(cat <<'EOF'
import os, sys, torch
from harness.builders import build_expert_inputs
from harness.case import Case
from backends.experts import config_from_call, context_from_call
from kernels.experts.dual_stream_experts import DualStreamTritonExperts
from kernels.experts.modular import FusedMoEKernel
from kernels.experts.prepare_finalize import NoEPPrepareAndFinalize
from kernels.schedule.cuda import CudaSchedule

assert torch.cuda.is_available(), "no CUDA device"
case = Case(level="expert", T=24, H=128, I=128, E=4, top_k=2, max_loras=2, max_rank=16, mapping="mixed",
            dtype="bfloat16", activation="silu", seed=3)
call = build_expert_inputs(case).call("cuda")
config = config_from_call(call)

def forward(experts, single):
    ctx = context_from_call(call, config)
    ctx.dual_stream = True
    if single:
        experts.dual_stream_schedule = CudaSchedule(single_stream=True)
    out = torch.empty_like(call.output)
    FusedMoEKernel(NoEPPrepareAndFinalize(), experts).apply(
        call.hidden_states, call.w13, call.w2, call.topk_weights, call.topk_ids, lora_ctx=ctx,
        expert_map=call.expert_map, w13_bias=call.w13_bias, w2_bias=call.w2_bias, output=out)
    torch.cuda.synchronize()
    return out

layer = DualStreamTritonExperts(config)
dual = [forward(layer, single=False) for _ in range(2)]
ref = forward(DualStreamTritonExperts(config), single=True)
sched = layer.dual_stream_schedule
assert isinstance(sched, CudaSchedule) and (sched.created_streams, sched.created_events) == (1, 4)
for d in dual:
    assert torch.equal(d.view(torch.int16), ref.view(torch.int16)), "dual-stream result differs from single stream"
assert not bool(ref.isnan().any())
print("MARKER", float(ref.float().abs().sum()))
EOF
)
PROGRAM=${PROGRAM//MARKER/$MARKER}

source ci/sanitize_verdict.sh  # verdict(): why a run does not count as a clean, finished run

rc=0
: > "$OUT/sanitize_summary.txt"
for tool in ${SANITIZE_TOOLS:-racecheck synccheck}; do
  log="$OUT/sanitize_${tool}.log"; stdout="$OUT/sanitize_${tool}.stdout"
  rm -f "$log"
  timeout "${SANITIZE_TIMEOUT:-900}" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 50 \
    --log-file "$log" "$PY" -c "$PROGRAM" > "$stdout" 2>&1
  code=$?
  why=$(verdict "$tool" "$log" "$stdout" "$code")
  if [[ -n $why ]]; then
    echo "FAIL $tool: $why (log: $log, output: $stdout)" | tee -a "$OUT/sanitize_summary.txt"
    tail -20 "$stdout"
    rc=1
  else
    echo "ok   $tool: $(summary_line "$log")" | tee -a "$OUT/sanitize_summary.txt"
  fi
done
exit $rc
