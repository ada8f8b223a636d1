"""`check --jobs N` and `selftest --jobs N` (harness.execution.job_pool): N job processes, one report, the same as one job's.

Small selections on the CPU: hostile op backends on two rows (one case each), the FP8 corpus under check's detector.
The jobs are forked by the fork server, which a test process starts once (a few CPU-seconds) and keeps."""
from __future__ import annotations

import json
import sys
import time

import pytest

from moe_lora_harness.harness.check import check_progress

from moe_lora_harness.harness.front import cli
from moe_lora_harness.harness.execution.job_pool import AUTO_MAX_JOBS, resolve_jobs

HOSTILE = "moe_lora_harness.suites.harness.hostile_backends:HOSTILE"
ROWS = ["--feature", "fp16", "--feature", "w2: mul_routed_weight", "--cases-per-feature", "1"]


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hang")


@pytest.fixture(autouse=True)
def one_environment(monkeypatch, marker_dir):
    """One environment for every run here (the jobs' thread counts as this process has them, the hang's marker), so
    that the jobs and the workers of every test come from one fork server, started once."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HOSTILE_HANG_MARKER", str(marker_dir / "hanging"))


def _check(tmp_path, name, *args):
    path = tmp_path / f"{name}.json"
    rc = cli.main(["check", "--device", "cpu", "--backend", HOSTILE, *args, "--json", str(path)])
    return rc, json.loads(path.read_text())


def _cells(data):
    """The matrix without what differs from run to run (seconds, a crash's addresses in the failure text)."""
    return {b: {f: {k: v for k, v in c.items() if k not in ("seconds", "failures")} for f, c in row.items()}
            for b, row in data["matrix"].items()}


def test_check_in_two_jobs_gives_one_jobs_matrix_and_a_crash_is_the_backends_cell(tmp_path):
    only = [a for n in ("hostile-control", "hostile-segfault", "hostile-system-exit") for a in ("--only", n)]
    rc1, one = _check(tmp_path, "one", *only, *ROWS, "--jobs", "1", "--timeout", "20")
    rc2, two = _check(tmp_path, "two", *only, *ROWS, "--jobs", "2", "--timeout", "20")
    assert rc1 == rc2 == 1
    assert _cells(two) == _cells(one) and list(two["matrix"]) == list(one["matrix"])
    assert two["meta"]["counts"] == one["meta"]["counts"] and two["meta"]["jobs"] == 2
    assert two["matrix"]["hostile-segfault"]["w2: mul_routed_weight"]["kinds"] == {"crash": 1}   # its worker died
    assert two["matrix"]["hostile-segfault"]["fp16"]["status"] == "pass" and not two["meta"]["interrupted"]


def test_a_job_that_dies_twice_on_a_run_is_a_harness_error_naming_it(tmp_path, capsys):
    """--in-process: the backend's segfault takes its job; a fresh job takes the run over once, then it is ours."""
    rc, data = _check(tmp_path, "d", "--only", "hostile-control", "--only", "hostile-segfault", *ROWS,
                      "--in-process", "--jobs", "2")
    err = capsys.readouterr().err
    assert rc == 3 and "HARNESS ERROR" in err and "killed by SIGSEGV running it twice" in err, err
    meta = data["meta"]
    assert meta["in_flight"]["backend"] == "hostile-segfault" and meta["in_flight"]["feature"] == "w2: mul_routed_weight"
    assert meta["not_run"] >= 1 and "SIGSEGV" in meta["harness_error"]


def test_ctrl_c_stops_the_jobs_keeps_what_finished_and_names_the_run_in_flight(tmp_path, monkeypatch, capsys,
                                                                              marker_dir):
    """Ctrl-C once the control's run has finished and the other job is in its hang (whichever comes last)."""
    marker, seen = marker_dir / "hanging", set()
    marker.unlink(missing_ok=True)
    start, finished = check_progress.CheckProgress.start, check_progress.CheckProgress.finished

    def interrupt_once_both(what):
        seen.add(what)
        if seen == {"control done", "hang started"}:
            for _ in range(600):
                if marker.exists():
                    break
                time.sleep(0.1)
            raise KeyboardInterrupt

    def on_start(self, backend, feature):
        start(self, backend, feature)
        if backend == "hostile-hang":
            interrupt_once_both("hang started")

    def on_finished(self, outcome, seconds):
        finished(self, outcome, seconds)
        interrupt_once_both("control done")
    monkeypatch.setattr(check_progress.CheckProgress, "start", on_start)
    monkeypatch.setattr(check_progress.CheckProgress, "finished", on_finished)
    rc, data = _check(tmp_path, "c", "--only", "hostile-control", "--only", "hostile-hang", "--feature",
                      "w2: mul_routed_weight", "--cases-per-feature", "1", "--in-process", "--jobs", "2")
    out = capsys.readouterr().out
    assert rc == 130 and "INTERRUPTED" in out and marker.exists(), out
    assert data["matrix"]["hostile-control"]["w2: mul_routed_weight"]["status"] == "pass"
    assert data["meta"]["in_flight"]["backend"] == "hostile-hang" and data["meta"]["not_run"] == 1


def test_a_budget_hands_out_no_run_past_it_and_lists_the_rest(tmp_path, monkeypatch):
    clock, real = [0.0], check_progress.CheckProgress.finished

    class Clock:          # each finished run moves this clock 100 s: a 1 s budget admits the first runs only
        monotonic = staticmethod(lambda: clock[0])
        time = staticmethod(lambda: 0.0)

    def finished(self, outcome, seconds):
        clock[0] += 100
        real(self, outcome, seconds)
    monkeypatch.setattr(cli, "time", Clock)
    monkeypatch.setattr(check_progress.CheckProgress, "finished", finished)
    rc, data = _check(tmp_path, "b", "--only", "hostile-control", "--only", "hostile-system-exit", *ROWS,
                      "--in-process", "--jobs", "2", "--budget", "1s")
    meta = data["meta"]
    ran = sum(meta["counts"].values())
    assert 1 <= ran <= 2 and meta["not_reached_runs"] == 4 - ran and not meta["interrupted"], meta
    assert sum(c["status"] == "not-reached" for row in data["matrix"].values() for c in row.values()) >= 4 - ran


def test_a_job_needs_nothing_of_the_parents_main_module(tmp_path, monkeypatch):
    """Run as `python -m moe_lora_harness.harness.front.cli`, the command's function is __main__'s, which no job has."""
    monkeypatch.setitem(sys.modules, "__main__", cli)
    monkeypatch.setattr(cli.cmd_check, "__module__", "__main__")
    rc, data = _check(tmp_path, "m", "--only", "hostile-control", *ROWS, "--in-process", "--jobs", "2")
    assert rc == 0 and data["meta"]["counts"]["pass"] == 2 and data["meta"]["jobs"] == 2


def test_selftest_in_two_jobs_prints_one_jobs_kill_matrix(tmp_path, capsys):
    args = ["selftest", "--device", "cpu", "--corpus", "fp8", "--detectors", "check", "--in-process"]
    assert cli.main(args + ["--jobs", "1", "--json", str(tmp_path / "one.json")]) == 0
    one_out = capsys.readouterr().out
    assert cli.main(args + ["--jobs", "2", "--json", str(tmp_path / "two.json")]) == 0
    two_out = capsys.readouterr().out
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))

    def kills(data):
        return {m: {d: (k["caught"], k["row"], k["rows"], k["runs"]) for d, k in cells.items()}
                for m, cells in data["mutants"].items()}
    assert kills(two) == kills(one) and two["controls"] == one["controls"] and two["jobs"] == 2
    matrix = [ln.split("killed")[0] for ln in two_out.splitlines() if ln.startswith("fp8/")]
    assert matrix == [ln.split("killed")[0] for ln in one_out.splitlines() if ln.startswith("fp8/")]
    assert len(matrix) == 5                 # 4 mutants (in plan order) and the control


@pytest.mark.parametrize("cmd", ["check", "selftest"])
@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5"])
def test_a_bad_jobs_value_is_a_usage_error_naming_it(cmd, value, capsys):
    assert cli.main([cmd, "--device", "cpu", "--jobs", value]) == 2
    err = capsys.readouterr().err
    assert "argument --jobs: expected a positive number or auto" in err and repr(value) in err, err


def test_auto_is_one_job_on_the_cpu_for_model_runs_and_in_process(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert resolve_jobs("auto", "cpu") == 1 and resolve_jobs(3, "cpu") == 3
    assert resolve_jobs("auto", "cuda") == 8 and resolve_jobs("auto", "cuda:1") == 8
    assert resolve_jobs("auto", "cuda", heavy=True) == 1 and resolve_jobs(2, "cuda", heavy=True) == 2
    assert resolve_jobs("auto", "cuda", in_process=True) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert resolve_jobs("auto", "cuda") == AUTO_MAX_JOBS
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert resolve_jobs("auto", "cuda") == 1


def test_jobs_take_the_layer_scenarios_first_and_the_backends_in_turn():
    """check --jobs' order without --budget: every layer scenario before any case, and within each kind the backends
    alternate (each one's first run, then each one's second), each backend's runs in plan order."""
    class Scenario:
        steps = ()
    plan = [("a", None, "f1", "case"), ("a", None, "f2", "case"), ("L1", None, "s1", Scenario()),
            ("L1", None, "s2", Scenario()), ("b", None, "f1", "case"), ("L2", None, "s1", Scenario())]
    assert cli._jobs_order(plan) == [2, 5, 3, 0, 4, 1]
