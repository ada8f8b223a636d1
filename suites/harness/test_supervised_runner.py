"""The supervised worker against hostile backends: every misbehaviour is a failure of that case, the run goes on.

Each hostile backend misbehaves only on `mul_routed_weight` cases (see hostile_backends.py); the case
below has it. After each failure the same supervisor must still run the control correctly (a fresh
worker where the old one died).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.registry import harness_command, load_ref
from moe_lora_harness.harness.execution.runner import MalformedCase, run_case
from moe_lora_harness.harness.execution.worker import WORKER_NAME, Supervisor

REF = "moe_lora_harness.suites.harness.hostile_backends:HOSTILE"
SPECS = {s.name: s for s in load_ref(REF)}
W2 = Case(T=3, H=24, I=16, E=4, top_k=2, max_rank=4, which="w2", num_slices=1, mul_routed_weight=True, seed=7)
W13 = Case(T=3, H=24, I=16, E=4, top_k=2, max_rank=4, seed=7)

EXPECTED = {   # backend -> (failure kind, text the reason must hold)
    "hostile-system-exit": ("raised", "SystemExit"),
    "hostile-keyboard-interrupt": ("raised", "KeyboardInterrupt"),
    "hostile-os-exit": ("crash", "exited with code 3"),
    "hostile-abort": ("crash", "SIGABRT"),
    "hostile-segfault": ("crash", "SIGSEGV"),
    "hostile-sigkill": ("crash", "SIGKILL"),
    "hostile-writes-x": ("input-written", "qcurr_hidden_states"),
    "hostile-writes-lora-a": ("input-written", "lora_a_stacked[0]"),
    "hostile-writes-topk-weights": ("input-written", "topk_weights"),
    "hostile-writes-expert-ids": ("input-written", "expert_ids"),
    "hostile-reads-past-x": ("nonfinite", "a read past an input's end"),
    "hostile-writes-past-output": ("outside-written", "output: 1 element(s) past its last"),
}


@pytest.fixture(scope="module")
def supervisor():
    with Supervisor(timeout=60) as s:
        yield s


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_backend_fails_the_case_and_the_run_goes_on(name, supervisor):
    kind, text = EXPECTED[name]
    out = run_case(SPECS[name], W2, "cpu", executor=supervisor, reruns=0)
    assert out.status == "fail" and out.kind == kind, (out.status, out.kind, out.detail)
    assert text in out.detail
    assert "CASE: " in out.detail and f"{harness_command()} replay --backend " + REF in out.detail
    after = run_case(SPECS["hostile-control"], W2, "cpu", executor=supervisor)
    assert after.status == "pass", after.detail


def test_the_misbehaviour_is_case_specific(supervisor):
    """Off the w2 cases the hostile backends are the reference: their other cells pass (the control of the test)."""
    for name in EXPECTED:
        assert run_case(SPECS[name], W13, "cpu", executor=supervisor).status == "pass", name


def test_a_crash_log_reaches_the_report(supervisor):
    out = run_case(SPECS["hostile-os-exit"], W2, "cpu", executor=supervisor, reruns=0)
    assert "hostile: calling os._exit(3)" in out.detail


def test_a_hang_is_a_timeout_and_the_worker_is_replaced():
    with Supervisor(timeout=1) as s:     # the control's calls take under 0.1 s; the hang costs the timeout
        t0 = time.monotonic()
        out = run_case(SPECS["hostile-hang"], W2, "cpu", executor=s)
        assert out.status == "fail" and out.kind == "timeout", out.detail
        assert time.monotonic() - t0 < 30     # a hang is not re-run: it would cost the timeout again
        assert run_case(SPECS["hostile-control"], W2, "cpu", executor=s).status == "pass"
        assert s.restarts == 1


def test_after_a_death_a_started_spare_takes_over_and_close_leaves_no_process():
    """From the first death on, a spare worker is started beside the active one, so the next death costs no
    worker start: the spare runs the next case; closing stops both."""
    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    with Supervisor(timeout=60) as s:
        assert run_case(SPECS["hostile-control"], W2, "cpu", executor=s).status == "pass"
        assert s._spare is None                       # no death yet: one process
        assert run_case(SPECS["hostile-os-exit"], W2, "cpu", executor=s, reruns=0).kind == "crash"
        assert run_case(SPECS["hostile-control"], W2, "cpu", executor=s).status == "pass"
        spare = s._spare.proc.pid
        assert run_case(SPECS["hostile-segfault"], W2, "cpu", executor=s, reruns=0).kind == "crash"
        assert run_case(SPECS["hostile-control"], W2, "cpu", executor=s).status == "pass"
        assert s.proc.pid == spare and s.restarts == 2
        pids = [s.proc.pid, s._spare.proc.pid]
    assert not any(alive(p) for p in pids)


def test_a_nondeterministic_backend_is_named_so_with_every_outcome(supervisor):
    spec = SPECS["hostile-nondeterministic"]
    seen = [run_case(spec, W13, "cpu", executor=supervisor) for _ in range(2)]
    bad = next(o for o in seen if o.failed)
    assert bad.kind == "nondeterministic", bad.detail
    assert len(bad.runs) == 3 and "pass" in bad.runs and len(set(bad.runs)) == 2
    assert "outcome changed between 3 runs" in bad.detail


def test_in_process_runs_catch_system_exit_too():
    out = run_case(SPECS["hostile-system-exit"], W2, "cpu", reruns=0)
    assert out.status == "fail" and out.kind == "raised" and "SystemExit" in out.detail


def test_a_malformed_case_is_not_a_backend_failure():
    with pytest.raises(MalformedCase, match="top_k"):
        run_case(SPECS["hostile-control"], Case(E=2, top_k=3), "cpu")


def _cli(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "moe_lora_harness", *args], capture_output=True, text=True,
                          timeout=timeout, env=_child_env(), **kw)


def _child_env() -> dict:
    """This process's environment, with the package importable (also from a source tree not installed)."""
    import moe_lora_harness
    parent = os.path.dirname(os.path.dirname(os.path.abspath(moe_lora_harness.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([parent, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))


def _pytest(*args):
    """pytest from the root directory, with our plugin (by entry point, or named when not installed)."""
    from importlib import metadata
    registered = any(ep.value == "moe_lora_harness.harness.front.pytest_plugin" for ep in metadata.entry_points(group="pytest11"))
    plugin = [] if registered else ["-p", "moe_lora_harness.harness.front.pytest_plugin"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args],
                          capture_output=True, text=True, timeout=600, cwd="/", env=_child_env())


def test_check_over_hostile_backends_writes_the_whole_matrix(tmp_path):
    """One check over a crash, a hang, an exit, an input write and a flaky backend: every cell filled."""
    names = ["hostile-control", "hostile-system-exit", "hostile-segfault", "hostile-hang", "hostile-writes-x",
             "hostile-nondeterministic"]
    only = [a for n in names for a in ("--only", n)]
    features = [a for f in ("fp16", "w2: mul_routed_weight", "naive layout") for a in ("--feature", f)]
    # on the CPU wherever the suite runs: on a GPU machine check would take cuda and 8 jobs, each with its own
    # worker, and the flaky backend's call counter (one per process) would give each job's first call: a pass
    out = _cli("check", "--backend", REF, *only, *features, "--cases-per-feature", "1", "--timeout", "2",
               "--device", "cpu",
               "--json", str(tmp_path / "m.json"), "--markdown", str(tmp_path / "m.md"))
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "m.json").read_text())
    assert set(data["matrix"]) == set(names)
    control = data["matrix"]["hostile-control"]
    assert set(control) == {"fp16", "w2: mul_routed_weight", "naive layout"}
    assert all(c["status"] == "pass" for c in control.values())
    w2 = "w2: mul_routed_weight"
    for name, kind in (("hostile-system-exit", "raised"), ("hostile-segfault", "crash"), ("hostile-hang", "timeout"),
                       ("hostile-writes-x", "input-written")):
        cell = data["matrix"][name][w2]
        assert cell["status"] == "fail" and cell["kinds"] == {kind: 1}, (name, cell)
        assert data["matrix"][name]["fp16"]["status"] == "pass", name   # the run went on after it
    flaky = data["matrix"]["hostile-nondeterministic"]   # calls 1 (pass), 2 (fail), 3 (pass), 4 (fail)...
    assert any(c["kinds"].get("nondeterministic") for c in flaky.values()), flaky
    assert data["meta"]["worker_restarts"] >= 2 and not data["meta"]["interrupted"]
    assert "| feature |" in (tmp_path / "m.md").read_text()
    assert "REPRO: " in out.stdout


def test_ctrl_c_keeps_the_results_and_names_the_case_in_flight(tmp_path):
    marker = tmp_path / "hanging"
    proc = subprocess.Popen([sys.executable, "-m", "moe_lora_harness", "check", "--backend", REF,
                             "--only", "hostile-hang", "--cases-per-feature", "1", "--timeout", "120",
                             "--device", "cpu",      # the CPU's row order (a GPU machine's check has its own)
                             "--json", str(tmp_path / "m.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HOSTILE_HANG_MARKER=str(marker)),
                            # as a terminal's foreground job has it: a suite started in the background by a
                            # non-interactive shell inherits SIGINT ignored, and Python then never raises on it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = _worker_pids(proc.pid)
    assert marker.exists() and workers, "the hang never started"
    proc.send_signal(signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:   # keep what it said
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail("check did not exit within 120 s of its Ctrl-C; its output ends:\n" + stdout[-3000:]
                    + "\n--- stderr ---\n" + stderr[-3000:])
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    data = json.loads((tmp_path / "m.json").read_text())
    assert data["meta"]["interrupted"] and data["meta"]["in_flight"]["backend"] == "hostile-hang"
    assert data["meta"]["in_flight"]["feature"] == "w2: mul_routed_weight"
    assert data["matrix"]["hostile-hang"]["fp16"]["status"] == "pass"
    assert "INTERRUPTED" in stdout and data["meta"]["not_run"] > 0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers), "the worker outlived the harness"


def _worker_pids(parent_pid: int) -> list[int]:
    """The harness's worker processes (its descendants: the fork server's children), read from /proc."""
    parent, name = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            parent[int(entry)], name[int(entry)] = int(rest.split()[1]), head.split("(", 1)[1]
        except (OSError, ValueError, IndexError):
            continue   # exited while we looked

    def descends(pid):
        while pid in parent and pid > 1:
            pid = parent[pid]
            if pid == parent_pid:
                return True
        return False
    return [pid for pid, comm in name.items() if comm == WORKER_NAME and descends(pid)]


@pytest.mark.starts_first
def test_pytest_lane_counts_the_tests_that_never_ran():
    """In-process (no worker), a segfaulting backend kills the xdist workers (none restarted); the plugin's
    summary says how many tests never ran and the session fails."""
    out = _pytest("-n", "2", "--max-worker-restart", "0", "--pyargs", "moe_lora_harness.suites.conformance",
                  "-k", "test_feature", "--moe-lora-backend", REF, "--moe-lora-only", "hostile-segfault",
                  "--moe-lora-in-process", "--moe-lora-cases-per-feature", "1", "--moe-lora-device", "cpu")
    assert out.returncode != 0, out.stdout[-3000:]
    assert "tests that never ran" in out.stdout and "collected tests never ran" in out.stdout, out.stdout[-3000:]


def test_supervised_pytest_lane_runs_every_test_despite_a_segfault():
    """The supervised worker takes the segfault, the lane goes on. One pytest process: the containment is the
    worker's, not xdist's (test_pytest_lane_counts_the_tests_that_never_ran runs the lane under xdist, where
    two more processes cost ~15 s of CI's two cores)."""
    out = _pytest("-p", "no:xdist", "--pyargs", "moe_lora_harness.suites.conformance",
                  "-k", "test_feature and (fp16 or mul_routed)", "--moe-lora-backend", REF,
                  "--moe-lora-only", "hostile-segfault", "--moe-lora-cases-per-feature", "1", "--moe-lora-device", "cpu")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "1 failed, 1 passed" in out.stdout and "never ran" not in out.stdout, out.stdout[-3000:]
    assert "kind=crash" in out.stdout and "SIGSEGV" in out.stdout


def test_fuzz_reports_a_nondeterministic_backend_without_a_traceback():
    out = _cli("fuzz", "--backend", REF, "--only", "hostile-nondeterministic", "--max-examples", "20", "--no-db",
               "--seed", "3")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert ("kind=nondeterministic" in out.stdout or "NONDETERMINISTIC" in out.stdout), out.stdout[-2000:]
    assert "Traceback" not in out.stdout + out.stderr and "REPRO: " in out.stdout


def test_pytest_lane_times_out_a_hanging_test_and_goes_on():
    """In-process, a hang is stopped by the per-test timeout: that test fails, the next one runs."""
    out = _pytest("-p", "no:xdist", "--pyargs", "moe_lora_harness.suites.conformance",
                  "-k", "test_feature and (fp16 or mul_routed)", "--moe-lora-backend", REF,
                  "--moe-lora-only", "hostile-hang", "--moe-lora-in-process", "--moe-lora-cases-per-feature", "1",
                  "--moe-lora-test-timeout", "2", "--moe-lora-device", "cpu")
    assert out.returncode == 1, out.stdout[-3000:]
    assert "1 failed, 1 passed" in out.stdout and "ran past --moe-lora-test-timeout=2s" in out.stdout, out.stdout[-3000:]


def test_pytest_lane_rejects_an_unknown_device():
    out = _pytest("--pyargs", "moe_lora_harness.suites.conformance", "--moe-lora-device", "gpu")
    assert out.returncode == 4 and "--moe-lora-device: expected cpu, cuda or cuda:N; got 'gpu'" in out.stderr, \
        out.stdout[-1000:] + out.stderr[-1000:]


def test_a_declaration_that_raises_is_the_backends_failure():
    import dataclasses

    from moe_lora_harness.harness.spec.contract import Capabilities, Rule

    def broken(case):
        raise ZeroDivisionError("rule bug")
    spec = dataclasses.replace(SPECS["hostile-control"], capabilities=Capabilities(
        levels=frozenset({"op"}), rules=(Rule("broken", broken, "always raises"),)))
    out = run_case(spec, W13, "cpu")
    assert out.status == "fail" and out.kind == "declaration" and "ZeroDivisionError: rule bug" in out.detail


def test_the_gate_tier_deselects_the_full_tier_and_says_so():
    """On a CPU device the gate tier (CI's) leaves out the tests marked slow and says so; the full tier keeps every
    item (ci/gpu.sh's CPU full tier runs `-m slow` with --moe-lora-tier full: a lane that ran none would fail)."""
    from types import SimpleNamespace

    from moe_lora_harness.harness.front import pytest_plugin
    gate = _pytest("--co", "-p", "no:xdist", "--pyargs", "moe_lora_harness.suites.layer.test_layer_scenarios",
                   "-k", "planted_layer_bug", "--moe-lora-device", "cpu")
    assert gate.returncode == 0, gate.stdout[-2000:]
    assert "fails_its_check_row" in gate.stdout and "fails_under_fuzz" not in gate.stdout, gate.stdout[-2000:]
    assert "tests marked slow (the full tier) were deselected" in gate.stdout, gate.stdout[-2000:]
    items = [SimpleNamespace(path=pytest_plugin.SUITES_DIR / "x.py", get_closest_marker=lambda name: name == "slow")]
    full = SimpleNamespace(getoption=lambda name: "full" if name == "moe_lora_tier" else None)
    pytest_plugin.pytest_collection_modifyitems(full, items)
    assert len(items) == 1


def test_a_parallel_cuda_session_leaves_the_gpu_alone_tests_out_and_says_how_to_run_them(monkeypatch):
    """Production-size cases (marked gpu_alone) do not fit an 80 GB GPU two at once: a session of several xdist
    workers on CUDA deselects them and its summary names the command that runs them apart; one worker, or the CPU,
    keeps them."""
    from types import SimpleNamespace

    from moe_lora_harness.harness.front import pytest_plugin

    def item(mark):
        return SimpleNamespace(path=pytest_plugin.SUITES_DIR / "x.py", get_closest_marker=lambda name: name == mark)

    deselected = []
    config = SimpleNamespace(getoption=lambda name: "full" if name == "moe_lora_tier" else None, stash=pytest.Stash(),
                             hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
    for workers, device, kept in ((4, "cuda", 1), (1, "cuda", 2), (4, "cpu", 2), (None, "cuda", 2)):
        config.workerinput = {"workercount": workers} if workers else None      # an xdist worker's; None: no xdist
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")      # inherited by a pytest a worker starts: not parallel
        monkeypatch.setattr(pytest_plugin, "selected_device", lambda config, d=device: d)
        items, deselected[:] = [item("gpu_alone"), item("gpu")], []
        pytest_plugin.pytest_collection_modifyitems(config, items)
        assert len(items) == kept and len(deselected) == 2 - kept, (workers, device)
        assert all(i.get_closest_marker("gpu_alone") for i in deselected)
    lines = []
    monkeypatch.setattr(pytest_plugin._LEDGER, "ours", True)
    config.stash[pytest_plugin._ALONE] = 1
    pytest_plugin.pytest_terminal_summary(SimpleNamespace(line=lines.append), 0, config)
    assert any("1 production-size tests (marked gpu_alone) were deselected" in x and pytest_plugin.ALONE_ARGS in x
               for x in lines), lines


def test_our_longest_tests_start_first_and_a_users_keep_their_order():
    """pytest-xdist hands tests out in collection order: ours marked starts_first go to the front, in their order,
    so that a parallel run does not wait for one at its end (the gate's 15 s jedi test was collected last); a
    user's tests, marked or not, keep their places, and every item stays."""
    from types import SimpleNamespace

    from moe_lora_harness.harness.front import pytest_plugin

    def item(name, mark=None, ours=True):
        where = pytest_plugin.SUITES_DIR if ours else pytest_plugin.SUITES_DIR.parent.parent / "elsewhere"
        return SimpleNamespace(name=name, path=where / "x.py", get_closest_marker=lambda m: m == mark)

    config = SimpleNamespace(getoption=lambda name: "full" if name == "moe_lora_tier" else None, stash=pytest.Stash())
    items = [item("a"), item("user", "starts_first", ours=False), item("b", "starts_first"), item("c"),
             item("d", "starts_first")]
    pytest_plugin.pytest_collection_modifyitems(config, items)
    assert [i.name for i in items] == ["b", "d", "a", "user", "c"]


def test_a_worker_profiles_its_requests_where_asked(tmp_path, monkeypatch):
    """MOE_LORA_HARNESS_WORKER_PROFILE=DIR (bench/profile_paths.py): the worker writes a cProfile of its requests
    into DIR, and the case's outcome is the same; unset, it writes none."""
    from moe_lora_harness.harness.execution.worker import PROFILE_VAR
    control = SPECS["hostile-control"]
    for asked in (True, False):
        folder = tmp_path / str(asked)
        folder.mkdir()
        if asked:
            monkeypatch.setenv(PROFILE_VAR, str(folder))
        else:
            monkeypatch.delenv(PROFILE_VAR, raising=False)
        with Supervisor() as sup:
            assert run_case(control, W13, "cpu", executor=sup, reruns=0).status == "pass"
        assert bool(list(folder.glob("worker-*.prof"))) == asked


def test_the_harness_s_own_reference_failing_is_not_the_backend_s_failure(monkeypatch):
    """The backend's declarations (rules, precision function, its model's name) are its to answer for; the float64
    reference after them is the harness's: an error there is raised (check and fuzz report a harness error), never
    turned into the backend's `declaration` failure, as it had been."""
    import dataclasses

    from moe_lora_harness.harness.execution import runner

    def broken_reference(*a, **k):
        raise RuntimeError("a bug of the harness's reference")
    monkeypatch.setattr(runner, "_expectations", broken_reference)
    with pytest.raises(RuntimeError, match="a bug of the harness's reference"):
        run_case(SPECS["hostile-control"], W13, "cpu")
    monkeypatch.undo()
    unknown = dataclasses.replace(SPECS["hostile-control"], precision="one_shot_nonsense")
    out = run_case(unknown, W13, "cpu")
    assert out.status == "fail" and out.kind == "declaration" and "one_shot_nonsense" in out.detail, out.detail


def test_an_fp8_accumulation_declaration_that_raises_is_the_backends_declaration_failure(monkeypatch):
    """BackendSpec.fp8_mma may be a function of the case, the backend's code: where the judge asks it (an FP8 expert
    case on an sm_90 GPU) its error is the backend's `declaration` failure, raised inside declared_rounding, which
    run_case answers for the backend (here asked directly: no GPU runs the case)."""
    import dataclasses

    import torch

    from moe_lora_harness.harness.judge.expectation import declared_rounding
    from moe_lora_harness.harness.spec.registry import available_backends

    def broken(case):
        raise KeyError("no tile for this case")
    spec = dataclasses.replace(available_backends()["triton_experts"], fp8_mma={"cuda": broken})
    fp8 = Case(level="expert", quant="fp8_w8a8", dtype="bfloat16", H=256, I=256, E=4, T=8)
    assert declared_rounding(spec, fp8, "cpu")[2] is None                   # not asked where it cannot apply
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(KeyError, match="no tile"):
        declared_rounding(spec, fp8, "cuda:0")
    assert declared_rounding(spec, fp8.replace(quant="none"), "cuda:0")[2] is None


def test_the_harness_out_of_memory_drawing_inputs_is_not_runnable_not_the_backends_failure(monkeypatch):
    """Out of device memory while the harness draws a case's inputs (before the backend is called) is the machine's
    limit: the case is not runnable, with the reason, never the backend's `raised` failure (H100, fifty-fifth
    session: DeepSeek-V3's FP8 rows, whose memory estimate fell short, were reported as our kernel raising)."""
    import torch

    from moe_lora_harness.harness.execution import execute
    from moe_lora_harness.harness.spec.registry import available_backends

    def no_memory(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB.")
    for name in ("build_op_inputs", "build_expert_inputs"):
        monkeypatch.setattr(execute, name, no_memory)
    expert = Case(level="expert", T=3, H=24, I=16, E=4, top_k=2, max_rank=4, seed=7)
    for spec, case in ((SPECS["hostile-control"], W13), (available_backends()["eager"], expert)):
        out = run_case(spec, case, "cpu")
        assert out.status == "not-runnable" and "ran out of device memory" in out.reason, (out.status, out.reason)
        assert "14.00 GiB" in out.reason
    monkeypatch.undo()
    assert run_case(SPECS["hostile-control"], W13, "cpu").status == "pass"
