#!/usr/bin/env bash
# Correct backends on random cases (bench/validate_correct.py), one job after another, until END seconds after T0;
# the one loop a GPU call script runs after its lane (each session's bench/results/*/callN.sh calls it).
#   T0=$(date +%s) END=570 bash bench/gpu_validate.sh LOG "BACKEND LEVEL PRESET SEED [DEVICE [DTYPE]]" ...
# BACKEND: a built-in name or file.py:NAME; each job gets at most 40 s of search (less near END) and is skipped with a
# line saying so when under 25 s are left. DTYPE: float32 (the default), float16, bfloat16 or any. Appends to LOG;
# prints each job's rc and the elapsed seconds.
set -u
LOG=$1
shift
T0=${T0:-$(date +%s)}
END=${END:-570}
mkdir -p "$(dirname "$LOG")"
left() { echo $(( END - ($(date +%s) - T0) )); }
for job in "$@"; do
  set -- $job
  device=${5:-cuda}
  dtype=${6:-float32}
  l=$(left)
  (( l > 25 )) || { echo "$1 $2 $3: no time left" | tee -a "$LOG"; continue; }
  t=$(( l < 45 ? l - 5 : 40 ))
  echo "== $1 $2 $3 seed $4 on $device, $dtype (${t}s)" >> "$LOG"
  timeout $(( t + 20 )) python3 bench/validate_correct.py "$1" --level "$2" --preset "$3" --device "$device" \
    --dtype "$dtype" --seconds "$t" --seed "$4" 2>&1 | grep -v "default MoE config" >> "$LOG"
  echo "$1 $2 $3 rc=${PIPESTATUS[0]} [$(( $(date +%s) - T0 ))s]" | tee -a "$LOG"
done
