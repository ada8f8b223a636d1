"""Op- and expert-level conformance of every registered backend against the float64 reference (features + hypothesis).

Test ids are `backend/feature/index`, stable across runs and workers, so `-k`, `-n auto` and sharding work.
An unsupported case is skipped with the backend's declared reason; a claimed case that fails or raises
fails with its case JSON and a REPRO command; a known-bug ledger entry that passes fails too.
"""
from __future__ import annotations

import warnings

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

from moe_lora_harness.harness.pytest_plugin import selected_backends, selected_device
from moe_lora_harness.harness.features import FEATURES, feature_cases
from moe_lora_harness.harness.runner import run_case
from moe_lora_harness.harness.strategies import expert_cases, op_cases, suite_settings


class UnclaimedCapabilityWarning(UserWarning):
    """A backend passed a case it declares unsupported: its declaration undersells it."""


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "backend_name" not in metafunc.fixturenames:
        return
    device = selected_device(config)
    names = sorted(selected_backends(config))
    if "feature_case" in metafunc.fixturenames:
        n = config.getoption("moe_lora_cases_per_feature") or (3 if device.startswith("cuda") else 2)
        params, ids = [], []
        specs = selected_backends(config)
        for name in names:
            levels = specs[name].capabilities.levels   # a backend is asked only at the levels it has
            for feat, i, case in feature_cases([f for f in FEATURES if f.level in levels], device, n):
                params.append((name, case))
                ids.append(f"{name}/{feat.name}/{i}")
        metafunc.parametrize(("backend_name", "feature_case"), params, ids=ids)
    else:
        specs = selected_backends(config)
        level = "expert" if "expert" in metafunc.function.__name__ else "op"
        metafunc.parametrize("backend_name", [n for n in names if level in specs[n].capabilities.levels])


def judge(outcome):
    """Turn an Outcome into a pytest result."""
    if outcome.status == "unsupported":
        pytest.skip(f"unsupported by {outcome.backend}: {outcome.reason}")
    if outcome.status == "works-unclaimed":
        warnings.warn(UnclaimedCapabilityWarning(f"{outcome.backend}: {outcome.reason}: {outcome.case.to_json()}"))
        return
    if outcome.status == "xfail":
        pytest.xfail(outcome.reason)
    if outcome.failed:
        pytest.fail(outcome.detail or outcome.reason, pytrace=False)


def test_feature(backend_name, feature_case, backends, device, probe_unsupported):
    judge(run_case(backends[backend_name], feature_case, device, probe=probe_unsupported))


def run_drawn(spec, case, device):
    """Judge a hypothesis-drawn case: declined or ledgered cases pass quietly, failures fail with REPRO."""
    outcome = run_case(spec, case, device)
    note(f"CASE: {case.to_json()}")
    if outcome.failed:
        pytest.fail(outcome.detail, pytrace=False)


def _dtypes(device):
    return ("float16", "float32") if device == "cpu" else ("bfloat16", "float16", "float32")


@suite_settings()
@given(data=st.data())
def test_op_random(backend_name, backends, device, data):
    """Hypothesis-drawn op cases; failures shrink to a minimal case and print its REPRO line."""
    spec = backends[backend_name]
    case = data.draw(op_cases(dtypes=_dtypes(device), max_T=12 if device == "cpu" else 200,
                              max_dim=96 if device == "cpu" else 700), label="case")
    run_drawn(spec, case, device)


@suite_settings()
@given(data=st.data())
def test_expert_random(backend_name, backends, device, data):
    """Hypothesis-drawn expert-level cases for every expert backend (activation, LoRA mix, EP, quant...)."""
    spec = backends[backend_name]
    case = data.draw(expert_cases(dtypes=_dtypes(device), max_T=10 if device == "cpu" else 128,
                                  max_dim=96 if device == "cpu" else 512), label="case")
    run_drawn(spec, case, device)
