#!/usr/bin/env bash
# A small dual-stream expert forward (Triton experts, LoRA deltas on the aux stream; the program is
# suites/schedule/sanitize_program.py) under NVIDIA compute-sanitizer: racecheck (shared-memory hazards inside
# our kernels) and synccheck (invalid barrier use). Then memcheck over a layer's named rows (`check --in-process`:
# the layer's kernels run in the sanitized process; graph captures, padded and zero-token replays included):
# padding rows' values are free, but nothing may read or write out of bounds (issue 31). SANITIZE_LAYER names the
# layer (default layer_triton), SANITIZE_LAYER_BACKEND a --backend REF to load it from (a user's layer),
# SANITIZE_LAYER_FEATURE the rows (default "graph:": captures, padded and zero-token replays, every dtype; under
# memcheck a row takes about 30 s on the H200, so all 39 runs of layer_triton's rows need about 20 minutes);
# SANITIZE_LAYER_TIMEOUT its limit (default 600 s); SANITIZE_LAYER= skips it. GPU only; run on the H200 by the
# lead. Cross-stream ordering itself is checked by the Recorder (suites/schedule) and by the sleep-injection
# stress test (suites/schedule/test_gpu_stress.py).
#
# Fails when a tool reports an error, AND when a tool did not really run: the sanitizer binary is
# missing, its log lacks the "ERROR SUMMARY" line, or the program did not print its completion marker.
#   usage: OUT=dir bash ci/sanitize.sh            (logs: $OUT/sanitize_<tool>.log and .stdout)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/latest}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1   # the package, uninstalled
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

PROGRAM=moe_lora_harness.suites.schedule.sanitize_program   # prints $MARKER when its forward completed

source ci/sanitize_verdict.sh  # verdict(): why a run does not count as a clean, finished run

rc=0
: > "$OUT/sanitize_summary.txt"
for tool in ${SANITIZE_TOOLS:-racecheck synccheck}; do
  log="$OUT/sanitize_${tool}.log"; stdout="$OUT/sanitize_${tool}.stdout"
  rm -f "$log"
  timeout "${SANITIZE_TIMEOUT:-900}" "$SAN" --tool "$tool" --error-exitcode 86 --print-limit 50 \
    --log-file "$log" "$PY" -m "$PROGRAM" "$MARKER" > "$stdout" 2>&1
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
LAYER=${SANITIZE_LAYER-layer_triton}
if [[ -n $LAYER ]]; then
  log="$OUT/sanitize_memcheck_layer.log"; stdout="$OUT/sanitize_memcheck_layer.stdout"
  rm -f "$log"
  extra=(); [[ -n ${SANITIZE_LAYER_BACKEND:-} ]] && extra=(--backend "$SANITIZE_LAYER_BACKEND")
  # the caching allocator stays on (CUDA graphs capture from its pools): a read far outside a buffer (a slot index
  # from a stale or garbage mapping entry, times a slot's stride) leaves the segment and is reported
  timeout "${SANITIZE_LAYER_TIMEOUT:-600}" env -u PYTORCH_NO_CUDA_MEMORY_CACHING "$SAN" --tool memcheck \
    --error-exitcode 86 --print-limit 50 --log-file "$log" \
    bash -c '"$0" -m moe_lora_harness check --device cuda --in-process --jobs 1 -q --only "$1" "${@:3}" && echo "$2"' \
    "$PY" "$LAYER" "$MARKER" --feature "${SANITIZE_LAYER_FEATURE-graph:}" "${extra[@]}" > "$stdout" 2>&1
  code=$?
  why=$(verdict memcheck "$log" "$stdout" "$code")
  if [[ -n $why ]]; then
    echo "FAIL memcheck over $LAYER's rows: $why (log: $log, output: $stdout)" | tee -a "$OUT/sanitize_summary.txt"
    tail -20 "$stdout"
    rc=1
  else
    echo "ok   memcheck over $LAYER's rows: $(summary_line "$log"); $(grep -E '^[0-9]+ runs' "$stdout" | tail -1)" \
      | tee -a "$OUT/sanitize_summary.txt"
  fi
fi
exit $rc
