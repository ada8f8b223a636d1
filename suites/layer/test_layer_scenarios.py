"""Every selected layer backend through the named scenarios and the state machine (harness.layer.layer_scenarios,
harness.layer.layer_machine), in the supervised worker; and the planted layer bugs killed by both detectors.

Test ids are `backend/scenario`. A scenario a layer declines is skipped with its declared reason; a failing
one fails with its scenario JSON and a REPRO that replays it alone. The random test fails if the layer claims
no configuration (a test that ran nothing cannot pass). The planted bugs' controls are layer_triton and
layer_dual_stream's own layers (suites/layer/layer_mutants.CONTROL), whose rows here are the controls' run.
"""
from __future__ import annotations

import pytest

from moe_lora_harness.harness.layer.layer_machine import fuzz_config, search_layer
from moe_lora_harness.harness.layer.layer_runner import run_scenario
from moe_lora_harness.harness.layer.layer_scenarios import claimed_scenario, layer_scenarios
from moe_lora_harness.harness.front.pytest_plugin import full_tier_marks, selected_backends, selected_device
from moe_lora_harness.harness.draw.strategies import profile
from moe_lora_harness.suites.conformance.test_conformance import judge

RANDOM_EXAMPLES = 4    # state-machine examples per layer in the suite (ci profile: 20 / 5; the fuzz CLI explores)


def pytest_generate_tests(metafunc):
    if "layer_name" not in metafunc.fixturenames:
        return
    config = metafunc.config
    device = selected_device(config)
    specs = selected_backends(config)
    names = sorted(n for n, s in specs.items() if "layer" in s.capabilities.levels)
    if "layer_scenario" in metafunc.fixturenames:
        rows = layer_scenarios(device)
        params = [pytest.param(n, sc, marks=full_tier_marks(specs[n], device)) for n in names for _, sc in rows]
        ids = [f"{n}/{label.removeprefix('layer: ')}" for n in names for label, _ in rows]
        metafunc.parametrize(("layer_name", "layer_scenario"), params, ids=ids)
    else:
        metafunc.parametrize("layer_name", [pytest.param(n, marks=full_tier_marks(specs[n], device)) for n in names])


def test_layer_scenario(layer_name, layer_scenario, backends, device, executor):
    spec = backends[layer_name]
    judge(run_scenario(spec, claimed_scenario(spec, layer_scenario, device), device, executor=executor))


def test_layer_random(layer_name, backends, device, executor):
    """The state machine, derandomized in CI: loads, unloads, replacements, batches of every size, replays."""
    spec = backends[layer_name]
    config = fuzz_config(spec, device)
    if config is None:
        pytest.fail(f"{layer_name} claims no layer configuration on {device}: nothing could be tested")
    n = max(2, profile().max_examples // 5) if profile().max_examples < 100 else profile().max_examples // 20
    r = search_layer(spec, config, device, executor=executor, max_examples=min(n, RANDOM_EXAMPLES * 10),
                     derandomize=profile().derandomize, rounds=1)
    assert r.examples > 0
    if r.found:
        pytest.fail(r.found[0].detail, pytrace=False)


def _layer_corpus():
    from moe_lora_harness.harness.selftest.selftest import CORPORA
    return next(c for c in CORPORA if c.name == "layer")


LAYER_MUTANTS = [m.name for m in __import__("moe_lora_harness.suites.layer.layer_mutants",
                                            fromlist=["MUTANTS"]).MUTANTS]


def _planted(mutant: str, device: str):
    """The planted layer bug's spec (skipped on a GPU where it is a race only the CPU Recorder reports)."""
    from moe_lora_harness.suites.layer.layer_mutants import BACKENDS, SHOWS
    if device != "cpu" and SHOWS[mutant].startswith("raises"):
        pytest.skip("a race the CPU Recorder reports; on a GPU it shows only when the streams happen to interleave")
    return next(s for s in BACKENDS if s.name == mutant)


@pytest.mark.parametrize("mutant", LAYER_MUTANTS)
def test_planted_layer_bug_fails_its_check_row(mutant, device, executor):
    """Each planted layer bug fails one of check's named scenarios (its row in FAILS_NAMED: check runs every
    row, selftest too)."""
    from moe_lora_harness.suites.layer.layer_mutants import FAILS_NAMED
    spec = _planted(mutant, device)
    sc = dict(layer_scenarios(device))[FAILS_NAMED[mutant]]
    check = run_scenario(spec, claimed_scenario(spec, sc, device), device, executor=executor)
    assert check.status == "fail" and check.kind != "environment", (
        f"{mutant} passed check's row {FAILS_NAMED[mutant]!r}: {check.status} {check.reason}")


@pytest.mark.slow     # 2-25 s each on a CPU (the interpreter runs every state-machine step); on CUDA in ci/gpu.sh
@pytest.mark.parametrize("mutant", LAYER_MUTANTS)
def test_planted_layer_bug_fails_under_fuzz(mutant, device, executor):
    """The state machine (fuzz, derandomized, within 30 examples: selftest's detector, bounded by examples rather
    than seconds so a slow machine agrees) finds each planted layer bug."""
    from moe_lora_harness.harness.selftest.selftest import _fuzz_detector
    spec = _planted(mutant, device)
    fuzz = _fuzz_detector(spec, _layer_corpus(), device, executor, budget_s=600.0, max_examples=30)
    assert fuzz.caught, f"{mutant} survived 30 state-machine examples: {fuzz.error}"


def test_a_layer_that_does_not_pad_the_mapping_passes_every_graph_row(device, executor):
    """vLLM's padding (layer_mutants.UNPADDED: a padded replay's padding rows keep the last batch's slots) is not a
    bug: the padded replay after a full batch, and every other graph row, pass."""
    from moe_lora_harness.harness.layer.layer_scenarios import SCENARIOS
    from moe_lora_harness.suites.layer.layer_mutants import UNPADDED
    graph_rows = {f"layer: {sc.name}" for sc in SCENARIOS if sc.graphs}
    for label, sc in layer_scenarios(device):
        if label in graph_rows:
            o = run_scenario(UNPADDED, claimed_scenario(UNPADDED, sc, device), device, executor=executor)
            assert o.status == "pass", f"{label}: {o.detail or o.reason}"


def test_a_layer_failure_replays_alone_from_its_repro(tmp_path, device):
    """The REPRO of a failing scenario, run in a fresh shell elsewhere, fails the same way (and the scenario is
    printed as JSON that `replay --scenario` reads back)."""
    import os
    import subprocess

    from moe_lora_harness.harness.layer.layer_scenarios import SCENARIOS, layer_config
    from moe_lora_harness.harness.build.layer_scenario import Scenario
    from moe_lora_harness.harness.draw.profiles import SMALL_LAYER
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.suites.layer.layer_mutants import BACKENDS
    spec = next(s for s in BACKENDS if s.name == "layer-mutant-stale-mapping")
    sc = Scenario(layer_config(SMALL_LAYER, "float32"), tuple(SCENARIOS[0].steps(SMALL_LAYER)))
    o = run_scenario(spec, sc, device, executor=InProcess())
    assert o.status == "fail" and o.kind == "not-neutral" and "SCENARIO: {" in o.detail, o.detail
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "MOE_LORA_HARNESS_PROFILE"))}
    r = subprocess.run(["bash", "-c", o.repro.replace(" --scenario ", " --repeat 1 --scenario ", 1)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "kind=not-neutral" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
