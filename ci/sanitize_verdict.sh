# Verdict on one compute-sanitizer run, sourced by ci/sanitize.sh (and by suites/harness/test_sanitize_verdict.py,
# so the "a run that did not really happen never passes" rule is checked on CPU in CI).
# Needs MARKER: the line the sanitized program prints when its forward completed.
# The tool's closing line: racecheck prints "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)",
# the other tools "ERROR SUMMARY: N errors". No such line = the tool did not finish.
summary_line() { grep -E "(RACECHECK|ERROR) SUMMARY" "$1" | tail -1 | sed 's/^=* *//'; }
clean_summary() {  # zero errors, and for racecheck zero hazards of any severity
  [[ $1 =~ ^ERROR\ SUMMARY:\ 0\ errors ]] || [[ $1 =~ ^RACECHECK\ SUMMARY:\ 0\ hazards\ displayed\ \(0\ errors,\ 0\ warnings\) ]]
}
# verdict TOOL LOG STDOUT EXITCODE -> prints the reason it failed (nothing when it passed)
verdict() {
  local log=$2 stdout=$3 code=$4 line
  [[ -s $log ]] || { echo "no sanitizer log written"; return; }
  line=$(summary_line "$log")
  [[ -n $line ]] || { echo "no summary line in the log (the tool did not finish)"; return; }
  grep -q "$MARKER" "$stdout" || { echo "the forward did not complete (no '$MARKER' in its output)"; return; }
  [[ $code -eq 86 ]] && { echo "the sanitizer reported errors: $line"; return; }
  [[ $code -ne 0 ]] && { echo "exit code $code"; return; }
  clean_summary "$line" || echo "$line"
}
