#!/usr/bin/env bash
# Wheel smoke test: what a user gets from `pip install moe-lora-harness` (no source tree, no conftest.py).
#   1. build the project's wheel (from a copy of the working tree, so no build/ or egg-info lands here)
#   2. a fresh venv: torch==2.13.0 (CPU, pinned: an unpinned torch pulls a multi-GB CUDA build), the wheel
#      installed non-editable with its deps, then examples/moe_lora_example_backend (non-editable)
#   3. from an empty directory: nothing generic (harness, kernels, ...) at the top of site-packages; the
#      example backend found through its entry point by `list`, `check` and the pytest11 plugin
# Usage (repo root): bash ci/wheel_smoke.sh      env: PYTHON (default python3), KEEP=1 keeps the temp dir.
#   or in two phases, so the installs (1, 2) can run beside other work (.ci/run runs them beside its own
#   install): bash ci/wheel_smoke.sh prepare DIR; ...; bash ci/wheel_smoke.sh check DIR   (3, then DIR removed)
# About 1-2 minutes on 2 cores. Prints one summary line; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
T0=$(date +%s)
PHASE=${1:-all}
case $PHASE in all|prepare|check) ;; *) echo "wheel_smoke: unknown phase '$PHASE' (all, prepare, check)" >&2; exit 2 ;; esac
if [[ $PHASE == all ]]; then
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/wheel_smoke.XXXXXX")
else
  TMP=${2:?"wheel_smoke $PHASE: give the folder of the prepared venv"}
  mkdir -p "$TMP"
  TMP=$(cd "$TMP" && pwd)
fi
STEP=setup
SUMMARY=""

finish() {
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    echo "wheel_smoke${PHASE/all/}: OK in $(( $(date +%s) - T0 ))s${SUMMARY:+: $SUMMARY}"
  else
    echo "wheel_smoke${PHASE/all/}: FAILED at step '$STEP' (exit $rc) after $(( $(date +%s) - T0 ))s${KEEP:+; kept $TMP}" >&2
  fi
  # the prepared venv stays for the check phase (unless the preparation failed)
  [[ -n ${KEEP:-} || ( $PHASE == prepare && $rc -eq 0 ) ]] || rm -rf "$TMP"
  exit $rc
}
trap finish EXIT

log() { echo "== wheel_smoke: $*"; }
# run a step quietly; on failure show its output
quiet() { local out="$TMP/step.log"; if ! "$@" >"$out" 2>&1; then cat "$out" >&2; return 1; fi; }

SRC=$TMP/src
VPY=$TMP/venv/bin/python
VBIN=$TMP/venv/bin
if [[ $PHASE != check ]]; then

STEP="copy source"
mkdir -p "$SRC"
if git -C "$REPO" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # tracked and untracked-but-not-ignored files: what a clone (plus local edits) holds
  git -C "$REPO" ls-files -z --cached --others --exclude-standard \
    | tar -C "$REPO" --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -C "$SRC" -xf -
else
  cp -a "$REPO/." "$SRC/"
fi

STEP="fresh venv"
log "fresh venv in $TMP/venv"
"$PY" -m venv "$TMP/venv"
quiet "$VPY" -m pip install -q --upgrade pip

STEP="build wheel"
log "building the wheel"
(cd "$SRC" && quiet "$VPY" -m pip wheel -q --no-deps -w "$TMP/dist" .)
WHEEL=$(ls "$TMP"/dist/moe_lora_harness-*.whl)
log "built $(basename "$WHEEL")"

STEP="install torch==2.13.0"
log "installing torch==2.13.0, the wheel and the example backend"
quiet "$VPY" -m pip install -q --no-compile torch==2.13.0   # (no byte-compiling of files never imported)

STEP="install wheel"
quiet "$VPY" -m pip install -q --no-compile "$WHEEL"

STEP="install example backend"
quiet "$VPY" -m pip install -q "$SRC/examples/moe_lora_example_backend"

fi
if [[ $PHASE == prepare ]]; then
  STEP=done
  SUMMARY="the wheel and the example backend installed in a fresh venv in $TMP"
  exit 0
fi
WHEEL=$(ls "$TMP"/dist/moe_lora_harness-*.whl)

# Everything below runs from an empty directory with no PYTHONPATH: only the installed files count.
STEP="empty directory"
mkdir "$TMP/empty"
cd "$TMP/empty"
unset PYTHONPATH
export MOE_LORA_HARNESS_PROFILE=ci

STEP="site-packages layout"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
for name in harness kernels reference backends suites; do
  if [[ -e $SITE/$name ]]; then
    echo "generic top-level package '$name' installed in $SITE" >&2
    exit 1
  fi
done
PKG=$("$VPY" -c 'import os, moe_lora_harness; print(os.path.dirname(os.path.realpath(moe_lora_harness.__file__)))')
if [[ $PKG != "$(realpath "$SITE")/moe_lora_harness" ]]; then
  echo "moe_lora_harness imported from $PKG, not from the venv's site-packages $SITE" >&2
  exit 1
fi
log "site-packages: moe_lora_harness only, no generic top-level packages"

STEP="moe-lora-harness list"
"$VBIN/moe-lora-harness" list >"$TMP/list.txt" 2>&1 || { cat "$TMP/list.txt" >&2; exit 1; }
if ! grep -q '^example_op:' "$TMP/list.txt"; then
  cat "$TMP/list.txt" >&2
  echo "example_op is not listed: the example's entry point was not found" >&2
  exit 1
fi
log "list: $(grep -c '^[A-Za-z0-9_.:-]*: ' "$TMP/list.txt") backends, example_op among them"

STEP="moe-lora-harness check"
log "check --only example_op --cases-per-feature 1"
"$VBIN/moe-lora-harness" check --only example_op --device cpu --cases-per-feature 1 >"$TMP/check.txt" 2>&1 \
  || { cat "$TMP/check.txt" >&2; exit 1; }
CHECK_LINE=$(grep -E '^[0-9]+ runs:' "$TMP/check.txt" | tail -1 || true)
if [[ -z $CHECK_LINE ]] || ! grep -qE '[1-9][0-9]* pass' <<<"$CHECK_LINE"; then
  cat "$TMP/check.txt" >&2
  echo "check ran no passing case for example_op" >&2
  exit 1
fi
echo "   $CHECK_LINE"

STEP="pytest --pyargs"
log "pytest --pyargs moe_lora_harness.suites.conformance --moe-lora-only example_op"
# --moe-lora-* only parse if the pytest11 entry point loaded the plugin (there is no conftest.py here)
"$VPY" -m pytest --pyargs moe_lora_harness.suites.conformance --moe-lora-only example_op --moe-lora-device cpu \
  --moe-lora-cases-per-feature 1 --moe-lora-max-examples 5 -q -p no:cacheprovider >"$TMP/pytest.txt" 2>&1 \
  || { cat "$TMP/pytest.txt" >&2; exit 1; }
PYTEST_LINE=$(tail -1 "$TMP/pytest.txt")
if ! grep -qE '[1-9][0-9]* passed' <<<"$PYTEST_LINE"; then
  cat "$TMP/pytest.txt" >&2
  echo "pytest passed no test for example_op" >&2
  exit 1
fi
echo "   $PYTEST_LINE"

STEP=done
SUMMARY="$(basename "$WHEEL") installed in a fresh venv; example_op listed; check: ${CHECK_LINE%% in *}; pytest: $PYTEST_LINE"
