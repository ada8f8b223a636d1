"""The fork server (harness/execution/fork_server.py): a forked child is what a new Python would be for the harness, with
the exit status, output, environment and working directory it asked for, forked or (without fork) started."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from moe_lora_harness.harness.execution import fork_server
from moe_lora_harness.harness.execution.worker import child_env

HERE = "moe_lora_harness.suites.harness.test_fork_server"


def exits_with(code):
    os._exit(code)


def dies_by(sig):
    os.kill(os.getpid(), sig)


def raises():
    raise ValueError("planted failure")


def sleeps(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(3600)


def starts_a_sleeper_and_ends(path):
    """A caller that starts a child (which sleeps), waits for it to be running, then ends abruptly."""
    fork_server.start(f"{HERE}:sleeps", (path,), env=child_env())
    while not os.path.exists(path):
        time.sleep(0.01)
    os._exit(0)


def says(path):
    """Writes its pid, working directory, one variable of each kind and whether torch was already imported."""
    with open(path, "w") as f:
        f.write(repr((os.getpid(), os.getcwd(), os.environ.get("PYTEST_PLANTED"), os.environ.get("PLANTED"),
                      "torch" in sys.modules, os.getsid(0) == os.getpid())))
    print("said", flush=True)


@pytest.fixture(params=["forked", "started"])
def mode(request, monkeypatch):
    if request.param == "started":
        monkeypatch.setattr(fork_server, "available", lambda: False)
    elif not fork_server.available():
        pytest.fail("no fork on this platform: the harness starts every worker as a new Python")
    return request.param


def _run(target, *args, output=None, env=None, cwd=None):
    child = fork_server.start(f"{HERE}:{target}", args, env=env or child_env(), output=output, cwd=cwd)
    return child, child.wait(timeout=120)


@pytest.mark.parametrize("mode", ["forked"], indirect=True)   # a new Python's status is Popen's: 0 and 1 below
@pytest.mark.parametrize("target,args,code", [("exits_with", (3,), 3), ("dies_by", (int(signal.SIGABRT),), -signal.SIGABRT),
                                              ("raises", (), 1), ("exits_with", (0,), 0)])
def test_the_exit_status_is_the_childs(target, args, code, mode):
    assert _run(target, *args)[1] == code


def test_output_environment_and_directory_are_the_childs(mode, tmp_path):
    r, w = os.pipe()
    env = dict(child_env(), PYTEST_PLANTED="runtime", PLANTED="start")
    child, code = _run("says", str(tmp_path / "said"), output=w, env=env, cwd=str(tmp_path))
    os.close(w)
    with os.fdopen(r) as f:
        assert f.read() == "said\n"
    pid, cwd, runtime, start, had_torch, own_session = eval((tmp_path / "said").read_text())
    assert code == 0 and pid == child.pid and cwd == str(tmp_path) and own_session
    assert (runtime, start) == ("runtime", "start")
    assert had_torch or mode == "started"       # forked: torch came imported


def test_a_traceback_reaches_the_output(mode):
    r, w = os.pipe()
    _, code = _run("raises", output=w)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    assert code == 1 and "ValueError: planted failure" in out, out


def test_a_child_does_not_outlive_its_caller(tmp_path):
    """A caller that ends (a worker killed in the middle of an EP case) takes its children with it."""
    path = str(tmp_path / "pid")
    assert _run("starts_a_sleeper_and_ends", path)[1] == 0
    pid = int(open(path).read())
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = os.path.exists(f"/proc/{pid}")
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the child outlived the process that started it"
