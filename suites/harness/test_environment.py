"""A backend's environment: a declared setup runs once per worker before the first call; --setup gives one to
a backend that declares none; the backend's own environment check failing is an environment failure (not a
kernel bug, not re-run) and a fuzz campaign goes on past it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.spec.registry import load_ref
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.execution.worker import Supervisor
from moe_lora_harness.suites.harness import env_backends

REF = "moe_lora_harness.suites.harness.env_backends:BACKENDS"
SPECS = {s.name: s for s in load_ref(REF)}
CASE = Case(T=3, H=32, I=16, seed=4)


def _reset():
    env_backends.STATE.update(group=False, setups=0)


def test_an_environment_check_is_an_environment_failure():
    _reset()
    o = run_case(SPECS["needs-group"], CASE, "cpu", executor=InProcess())
    assert o.status == "fail" and o.kind == "environment", o.detail
    assert "--setup MODULE:ATTR" in o.detail and o.runs == []     # not re-run


def test_a_declared_setup_runs_once_per_process():
    _reset()
    for seed in (1, 2):
        o = run_case(SPECS["needs-group-with-setup"], CASE.replace(seed=seed), "cpu", executor=InProcess())
        assert o.status == "pass", o.detail
    assert env_backends.STATE["setups"] == 1


def test_a_failing_setup_fails_every_case_as_environment():
    o = run_case(SPECS["needs-group-broken-setup"], CASE, "cpu", executor=InProcess())
    assert o.kind == "environment" and "no GPU topology file" in o.detail


@pytest.mark.starts_first
def test_cli_setup_reaches_the_supervised_worker_and_the_repro():
    cmd = [sys.executable, "-m", "moe_lora_harness", "check", "--backend", REF, "--only", "needs-group",
           "--feature", "fp16", "--cases-per-feature", "1"]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "kind=environment" in bad.stdout, bad.stdout[-2000:]
    good = subprocess.run(cmd + ["--setup", "moe_lora_harness.suites.harness.env_backends:init_group"],
                          capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]


def test_a_campaign_goes_on_past_an_environment_failure():
    from moe_lora_harness.harness.search.campaign import Campaign
    from moe_lora_harness.harness.draw.strategies import claimed_cases
    _reset()
    spec = SPECS["needs-group"]
    c = Campaign(spec, "cpu", "op", InProcess(), max_examples=30, seed=1, reruns=0)
    r = c.run(claimed_cases(spec, "cpu", "op", max_T=6, max_dim=32))
    assert [f.outcome.kind for f in r.found] == ["environment"]
    assert r.examples >= 25          # it was recorded once, and the search went on


def test_the_repro_of_a_setup_backend_names_the_setup():
    spec = SPECS["needs-group"].__class__(**{**SPECS["needs-group"].__dict__,
                                              "setup": "moe_lora_harness.suites.harness.env_backends:broken_setup"})
    with Supervisor(timeout=60) as sup:
        o = run_case(spec, CASE, "cpu", executor=sup)
    assert o.kind == "environment" and "--setup moe_lora_harness.suites.harness.env_backends:broken_setup" in o.detail
