"""The layer search itself (harness.layer.layer_machine): it reaches every dtype the layer claims, draws mappings a layer
can take, holds its budget through the shrink, reproduces under a seed, and shrinks to the steps a failure needs;
and the load step's per-module ranks and scalings (harness.build.layer_scenario). At the CPU's layer shapes on the run's
device (in-process: a GPU run's Triton kernels cannot read CPU tensors)."""
from __future__ import annotations

import dataclasses

import pytest

from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.layer.layer_machine import fuzz_configs, minimize, search_layer, search_layers, unneeded
from moe_lora_harness.harness.layer.layer_runner import first_failure, layer_support
from moe_lora_harness.harness.build.layer_scenario import RUNS, Scenario, adapter
from moe_lora_harness.harness.layer.layer_scenarios import layer_config
from moe_lora_harness.harness.draw.profiles import SMALL_LAYER
from moe_lora_harness.suites.layer.layer_mutants import CONTROL, MUTANTS

MUTANT = {s.name: s for s in MUTANTS}


class Recording(InProcess):
    """InProcess that keeps every scenario it was asked to run."""

    def __init__(self):
        super().__init__()
        self.scenarios = []

    def execute_scenario(self, spec, scenario, device, start=0):
        self.scenarios.append(scenario)
        return super().execute_scenario(spec, scenario, device, start)


def _scenario_of(outcome) -> Scenario:
    return Scenario.from_json(next(ln[len("SCENARIO: "):] for ln in outcome.detail.splitlines()
                                   if ln.startswith("SCENARIO: ")))


def test_a_load_step_gives_w2_its_own_rank_and_scaling():
    c = layer_config(SMALL_LAYER, "float32")
    a = adapter(c, {"rank": 8, "w2_rank": 4, "w2_scaling": 1.0, "seed": 1})
    assert (a.w13_rank, a.w2_rank, a.scaling, a.w2_scaling) == (8, 4, 0.5, 1.0)
    plain = adapter(c, {"rank": 8, "seed": 1})
    assert (plain.w2_rank, plain.w2_scaling) == (8, 0.5)
    bad = Scenario(c, ({"do": "load", "slot": 0, "rank": 8, "w2_rank": 9, "seed": 1},
                       {"do": "load", "slot": 0, "rank": 2, "w2_scaling": float("nan"), "seed": 1}))
    assert [p.split(":")[1].split()[0] for p in bad.problems()] == ["w2_rank", "w2_scaling"], bad.problems()


def test_the_search_reaches_every_dtype_and_draws_only_what_the_layer_declares(device):
    """A layer that cannot map an unloaded slot (Capabilities.maps_unloaded_slots False: vLLM's adapter ids) nor
    reuse one gets only scenarios it claims (mappings over its live slots and -1, a load per slot); the search
    runs in each claimed dtype."""
    spec = CONTROL[0]
    spec = dataclasses.replace(spec, capabilities=dataclasses.replace(spec.capabilities, maps_unloaded_slots=False,
                                                                      slot_reuse=False))
    configs = fuzz_configs(spec, "cpu")
    assert [c.dtype for c in configs] == list(SMALL_LAYER.dtypes)
    ex = Recording()
    r = search_layers(spec, configs, device, executor=ex, max_examples=4, derandomize=True, rounds=1)
    assert not r.found and {sc.config.dtype for sc in ex.scenarios} == set(SMALL_LAYER.dtypes)
    assert sum(s["do"] in RUNS for sc in ex.scenarios for s in sc.steps) > 4
    for sc in ex.scenarios:
        assert layer_support(spec, sc, device) == (True, ""), sc.to_json()


class _Timeline:
    """The search's clock in virtual seconds: each run step an executor carries out costs the next of `costs` (so the
    verdict does not hang on how loaded the machine is: on a loaded 2-core machine real steps vary 3x)."""

    def __init__(self, costs):
        self.t, self.costs, self.i = 1000.0, costs, 0

    def monotonic(self) -> float:
        return self.t

    def ran(self, runs: int) -> None:
        for _ in range(runs):
            self.t += self.costs[self.i % len(self.costs)]
            self.i += 1


class OnTimeline(InProcess):
    def __init__(self, timeline):
        super().__init__()
        self.timeline = timeline

    def execute_scenario(self, spec, scenario, device, start=0):
        ex = super().execute_scenario(spec, scenario, device, start)
        self.timeline.ran(sum(s["do"] in RUNS for s in scenario.steps[start:]))
        return ex


def test_the_search_holds_its_budget_through_the_shrink(device, monkeypatch):
    """A planted bug found at once, then shrunk (hypothesis's shrink and minimize) and searched on: no step starts
    that the dearest step so far says would end past the budget, so the search ends within 10 % of it (a clock that
    starts any step before the deadline took 26 s of this 20 s budget)."""
    from moe_lora_harness.harness.layer import layer_machine
    timeline = _Timeline([4.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(layer_machine, "time", timeline)
    budget, spec = 20.0, MUTANT["layer-mutant-split-k-with-lora"]
    t0 = timeline.monotonic()
    r = search_layer(spec, fuzz_configs(spec, "cpu")[0], device, executor=OnTimeline(timeline), budget_s=budget,
                     max_examples=10**6, derandomize=True)
    wall = timeline.monotonic() - t0
    assert r.found and r.exhausted == "budget", (r.found, r.exhausted)
    assert wall <= 1.1 * budget, f"the search took {wall:.1f}s for a budget of {budget}s"


def test_a_seed_reproduces_the_search(device):
    spec, config = MUTANT["layer-mutant-split-k-with-lora"], layer_config(SMALL_LAYER, "float16")

    def found(seed):
        r = search_layer(spec, config, device, executor=InProcess(), max_examples=10, seed=seed, rounds=1,
                         shrink=False)
        assert r.found
        return _scenario_of(r.found[0]).to_json()

    assert found(1) == found(1)


LOAD0, LOAD1 = {"do": "load", "slot": 0, "rank": 8, "seed": 1}, {"do": "load", "slot": 1, "rank": 4, "seed": 2}
CAPTURE4, ADAPTER4 = {"do": "capture", "size": 4}, {"do": "forward", "mapping": [0, 0, 0, 0], "seed": 3}
BASE4 = {"do": "forward", "mapping": [-1, -1, -1, -1], "seed": 4}


@pytest.mark.parametrize("steps, drop", [
    ((LOAD0, LOAD1, CAPTURE4, ADAPTER4, BASE4), {1, 2}),   # unneeded from the start
    ((LOAD0, CAPTURE4, {"do": "replay", "size": 4, "mapping": [0, 0, 0, 0], "seed": 5}, ADAPTER4, BASE4), set()),
], ids=["unneeded", "unneeded-once-its-replay-went"])
def test_a_shrunk_failure_keeps_only_the_steps_it_needs(steps, drop, device):
    """minimize drops a capture no replay uses and a load of a slot no run maps, also once the removal of another
    step (the replay) leaves them so: a planted stale mapping shrinks to load, forward, forward."""
    spec, c = MUTANT["layer-mutant-stale-mapping"], layer_config(SMALL_LAYER, "float32")
    assert unneeded(steps) == drop
    sc, ex = Scenario(c, steps), InProcess()
    f = first_failure(spec, sc, device, ex.execute_scenario(spec, sc, device, 0))
    best, best_f, _ = minimize(spec, sc, f, device, ex)
    assert best.steps == (LOAD0, ADAPTER4, BASE4) and best_f.kind == f.kind == "not-neutral"


def test_fuzz_passes_its_seed_and_every_claimed_dtype_to_the_search(monkeypatch, tmp_path, capsys):
    from moe_lora_harness.harness.front import cli
    from moe_lora_harness.harness.layer import layer_machine
    seen = {}

    def search(spec, configs, device, **kw):
        seen.update(kw, dtypes=[c.dtype for c in configs])
        return layer_machine.SearchResult(exhausted="examples")

    monkeypatch.setattr(layer_machine, "search_layers", search)
    rc = cli.main(["fuzz", "--in-process", "--device", "cpu", "--only", "layer_triton", "--level", "layer", "--seed",
                   "5", "--max-examples", "6", "--no-db", "-q", "--out", str(tmp_path)])
    capsys.readouterr()
    assert rc == 0 and seen["seed"] == 5 and seen["dtypes"] == list(SMALL_LAYER.dtypes), seen
