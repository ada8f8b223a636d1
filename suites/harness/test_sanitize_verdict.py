"""ci/sanitize.sh's verdict: a compute-sanitizer run passes only if it finished clean; anything else fails.

The logs below are the shapes compute-sanitizer 2025.3 writes (racecheck closes with a RACECHECK SUMMARY line,
the other tools with ERROR SUMMARY); the clean racecheck and synccheck logs are the H200 runs' own.
"""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "DUAL_STREAM_SANITIZE_FORWARD_DONE"
HEAD = "========= COMPUTE-SANITIZER\n"
RACE_CLEAN = HEAD + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
SYNC_CLEAN = HEAD + "========= ERROR SUMMARY: 0 errors\n"

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash to source ci/sanitize_verdict.sh"),
    pytest.mark.skipif(not (ROOT / "ci" / "sanitize_verdict.sh").is_file(),
                       reason="ci/sanitize_verdict.sh is in the source repository only (not in the installed package)"),
]


def verdict(tmp_path, log: str | None, stdout: str, code: int) -> str:
    """Run verdict() from ci/sanitize_verdict.sh on a fabricated run; '' means the run passes."""
    lp, sp = tmp_path / "tool.log", tmp_path / "tool.stdout"
    if log is not None:
        lp.write_text(log)
    sp.write_text(stdout)
    script = f'MARKER={MARKER}; source ci/sanitize_verdict.sh; verdict tool "{lp}" "{sp}" {code}'
    res = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    return res.stdout.strip()


@pytest.mark.parametrize("log", [RACE_CLEAN, SYNC_CLEAN], ids=["racecheck", "synccheck"])
def test_clean_finished_run_passes(tmp_path, log):
    assert verdict(tmp_path, log, f"{MARKER} 1367.0\n", 0) == ""


@pytest.mark.parametrize("log,stdout,code,why", [
    (None, MARKER, 0, "no sanitizer log"),
    (HEAD, MARKER, 124, "did not finish"),  # killed by the timeout before the summary
    (RACE_CLEAN, "Traceback ...\n", 1, "did not complete"),
    (HEAD + "========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)\n", MARKER, 0, "2 hazards"),
    (HEAD + "========= RACECHECK SUMMARY: 1 hazards displayed (1 errors, 0 warnings)\n", MARKER, 86, "reported errors"),
    (HEAD + "========= ERROR SUMMARY: 10 errors\n", MARKER, 86, "reported errors"),
    (SYNC_CLEAN, MARKER, 3, "exit code 3"),
], ids=["no-log", "timed-out", "forward-crashed", "race-warnings", "race-errors", "sync-errors", "nonzero-exit"])
def test_anything_else_fails(tmp_path, log, stdout, code, why):
    assert why in verdict(tmp_path, log, stdout, code)
