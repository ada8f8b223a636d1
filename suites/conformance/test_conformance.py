"""Op- and expert-level conformance of every selected backend against the float64 reference (features + hypothesis).

Test ids are `backend/feature/index`, stable across runs and workers, so `-k`, `-n auto` and sharding work.
Backends run in a supervised worker (one per test process; --moe-lora-in-process to call them here), so a
backend that crashes or hangs fails its test and the session goes on. An unsupported case is skipped
with the backend's declared reason; a claimed case that fails or raises fails with its case JSON and a
REPRO command; a known-bug ledger entry that passes fails too. The random tests draw only cases the
backend claims, and fail if they could not draw one: a test that ran nothing cannot pass.
"""
from __future__ import annotations

import warnings

import pytest
from hypothesis import given, note
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.check.features import FEATURES, feature_cases
from moe_lora_harness.harness.draw.profiles import draw_sizes
from moe_lora_harness.harness.front.pytest_plugin import full_tier_marks, selected_backends, selected_device, tier
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.harness.draw.strategies import claimed_cases, suite_settings


class UnclaimedCapabilityWarning(UserWarning):
    """A backend passed a case it declares unsupported: its declaration undersells it."""


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "backend_name" not in metafunc.fixturenames:
        return
    device = selected_device(config)
    specs = selected_backends(config)
    names = sorted(specs)
    if "feature_case" in metafunc.fixturenames:
        n = config.getoption("moe_lora_cases_per_feature") or (
            3 if device.startswith("cuda") else 1 if tier(config) == "gate" else 2)
        params, ids = [], []
        for name in names:
            levels = specs[name].capabilities.levels   # a backend is asked only at the levels it has
            slow = full_tier_marks(specs[name], device)
            for feat, i, case in feature_cases([f for f in FEATURES if f.level in levels], device, n):
                params.append(pytest.param(name, case, marks=slow))
                ids.append(f"{name}/{feat.name}/{i}")
        metafunc.parametrize(("backend_name", "feature_case"), params, ids=ids)
    else:
        level = "expert" if "expert" in metafunc.function.__name__ else "op"
        metafunc.parametrize("backend_name", [pytest.param(n, marks=full_tier_marks(specs[n], device))
                                              for n in names if level in specs[n].capabilities.levels])


def judge(outcome):
    """Turn an Outcome into a pytest result."""
    if outcome.status == "unsupported":
        pytest.skip(f"unsupported by {outcome.backend}: {outcome.reason}")
    if outcome.status == "not-runnable":
        pytest.skip(f"{outcome.backend}: {outcome.reason}")
    if outcome.status == "works-unclaimed":
        warnings.warn(UnclaimedCapabilityWarning(f"{outcome.backend}: {outcome.reason}: {outcome.case.to_json()}"))
        return
    if outcome.status == "xfail":
        pytest.xfail(outcome.reason)
    if outcome.failed:
        pytest.fail(outcome.detail or outcome.reason, pytrace=False)


def test_feature(backend_name, feature_case, backends, device, probe_unsupported, executor):
    judge(run_case(backends[backend_name], feature_case, device, probe=probe_unsupported, executor=executor))


def run_random(spec, level: str, device: str, executor):
    """Hypothesis-drawn cases the backend claims; failures shrink to a minimal case and print its REPRO line.
    Fails if no claimed case could be drawn (the declarations and the strategy never meet); a backend that
    declines the device itself is skipped with its declared reason, as its feature rows are."""
    dev = "cuda" if device.startswith("cuda") else device
    if dev not in spec.capabilities.devices:
        pytest.skip(f"unsupported by {spec.name}: {support_for(spec, Case(level=level), device)[1]}")
    claimed = []

    @suite_settings()
    @given(data=st.data())
    def search(data):
        case = data.draw(claimed_cases(spec, device, level, **draw_sizes(device, level)), label="case")
        claimed.append(case)
        note(f"CASE: {case.to_json()}")
        outcome = run_case(spec, case, device, executor=executor)
        if outcome.failed:
            pytest.fail(outcome.detail, pytrace=False)

    try:
        search()
    except Unsatisfiable:
        pass          # no claimed case at all: said below
    assert claimed, (f"{spec.name}: no {level}-level case it claims on {device} was drawn; its declarations "
                     f"decline everything the strategy reaches, so this test would test nothing")


def test_op_random(backend_name, backends, device, executor):
    """Hypothesis-drawn op cases (shapes, routing skew, LoRA mix, layouts, EP, fully sharded...)."""
    run_random(backends[backend_name], "op", device, executor)


def test_expert_random(backend_name, backends, device, executor):
    """Hypothesis-drawn expert-level cases for every expert backend (activation, LoRA mix, EP, TP, quant...)."""
    run_random(backends[backend_name], "expert", device, executor)
