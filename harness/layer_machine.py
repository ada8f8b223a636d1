"""Hypothesis's stateful testing of a layer: a rule-based state machine draws the steps (from a start with an
adapter in slot 0 and every graph captured: load, replace and unload adapters, a zero-B adapter, batches of 0
to max_tokens tokens, mappings over loaded, unloaded and -1 slots, replays at the captured sizes), runs each
on the live layer and its twin, and judges every forward. A failure
shrinks to its shortest step sequence: the scenario JSON and the REPRO that replays it alone.

`search_layer` is the search `fuzz` runs at the layer level and the random test of suites/layer runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.errors import Flaky
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from moe_lora_harness.harness.contract import BackendSpec
from moe_lora_harness.harness.execute import InProcess
from moe_lora_harness.harness.layer_runner import LayerFailure, failed_outcome, first_failure
from moe_lora_harness.harness.layer_scenario import LayerState, Scenario
from moe_lora_harness.harness.layer_contract import LayerConfig

STEPS_PER_EXAMPLE = 12


class LayerFailed(AssertionError):
    """A judged step failed (the message holds the scenario and its REPRO)."""


class BudgetSpent(KeyboardInterrupt):
    """The search's time is up: an interrupt, which hypothesis passes on at once (any other exception would be
    a failure it shrinks); search_layer catches it."""


@dataclass
class SearchResult:
    """What a layer search found: the failures (Outcome, shrunk scenario cut after the failing step), the
    examples run, seconds, whether the budget ended it."""

    found: list = field(default_factory=list)
    examples: int = 0
    seconds: float = 0.0
    exhausted: str = ""


def _signature(failure: LayerFailure, scenario: Scenario) -> tuple:
    """(failure kind, feature, failing step kind): two failures with one signature are one bug."""
    return failure.kind, failure.feature, scenario.steps[failure.step]["do"]


def machine_for(spec: BackendSpec, config: LayerConfig, device: str, executor, known: list, record: dict,
                deadline: float | None = None):
    """A RuleBasedStateMachine class over `spec`'s layer built for `config`; a failure whose signature is in
    `known` is not reported again (the example stops judging); the last failure is left in `record`; after
    `deadline` (time.monotonic) an example runs nothing."""
    L, R, graphs = config.max_loras, config.max_rank, spec.capabilities.graphs
    sizes = tuple(config.capture_sizes)
    ranks = sorted({1, R // 2 or 1, R})

    class LayerMachine(RuleBasedStateMachine):
        @initialize(seed=st.integers(0, 2**16), adapter=st.integers(0, 99))
        def build(self, seed, adapter):
            # as a server starts: an adapter of the largest rank in slot 0 and every graph captured (later steps
            # replace it with another rank, unload it, load the other slots ...)
            start = [{"do": "load", "slot": 0, "rank": R, "seed": adapter}]
            start += [{"do": "capture", "size": size} for size in (sizes if graphs else ())]
            self.scenario = Scenario(config, tuple(start), seed)
            self.state = LayerState(config)
            self.done = 0          # steps sent to the layer
            record["examples"] = record.get("examples", 0) + 1
            self.stopped = False
            if deadline is not None and time.monotonic() > deadline:
                if "failure" not in record:
                    raise BudgetSpent()
                self.stopped = True     # shrinking a failure found in time: its best so far is kept

        def _step(self, step: dict, run: bool) -> None:
            self.scenario = self.scenario.with_steps((*self.scenario.steps, step))   # what rules may follow
            if run:                                                                    # reads the steps alone
                self._flush()

        def _flush(self) -> None:
            if self.stopped or self.done == len(self.scenario.steps):
                return
            start, self.done = self.done, len(self.scenario.steps)
            ex = executor.execute_scenario(spec, self.scenario, device, start)
            failure = first_failure(spec, self.scenario, device, ex, start, self.state)
            if failure is None:
                return
            self.stopped = True
            if _signature(failure, self.scenario) in known:
                return
            record["failure"], record["scenario"], record["log"] = failure, self.scenario, ex.log
            raise LayerFailed(failed_outcome(spec, self.scenario, device, failure, ex.log).detail)

        def _slot(self, data) -> int:
            """A slot: one loaded before (a replacement, an unload) or any."""
            used = sorted({s["slot"] for s in self.scenario.steps if s["do"] == "load"})
            return data.draw(st.one_of(st.sampled_from(used), st.integers(0, L - 1)) if used else st.integers(0, L - 1),
                             label="slot")

        @rule(data=st.data(), rank=st.sampled_from(ranks), seed=st.integers(0, 99),
              zero_b=st.sampled_from([False, False, False, True]))
        def load(self, data, rank, seed, zero_b):
            step = {"do": "load", "slot": self._slot(data), "rank": rank, "seed": seed}
            if zero_b:
                step["zero_b"] = True
            self._step(step, run=False)

        @rule(data=st.data())
        def unload(self, data):
            self._step({"do": "unload", "slot": self._slot(data)}, run=False)

        def _tokens(self, data, most: int) -> int:
            """A batch size: 0, 1, the largest, the last batch's again (a stale tail shows then), or any."""
            last = [len(s["mapping"]) for s in self.scenario.steps if s["do"] in ("forward", "replay")][-1:]
            fixed = sorted({0, 1, most, *[t for t in last if t <= most]})
            return data.draw(st.one_of(st.sampled_from(fixed), st.integers(0, most)), label="tokens")

        def _mapping(self, data, T: int) -> list:
            """Per-token slots (a loaded slot or -1 more often than any slot), or one slot for all (-1: a
            base-model batch)."""
            loaded = sorted({s["slot"] for s in self.scenario.steps if s["do"] == "load"})
            slot = st.one_of(st.sampled_from([-1, *loaded]), st.integers(-1, L - 1))
            one = slot.map(lambda s: [s] * T)
            return data.draw(st.one_of(st.lists(slot, min_size=T, max_size=T), one), label="mapping")

        @rule(data=st.data(), seed=st.integers(0, 99))
        def forward(self, data, seed):
            T = self._tokens(data, config.max_tokens)
            self._step({"do": "forward", "mapping": self._mapping(data, T), "seed": seed}, run=True)

        @precondition(lambda self: bool(self._captured()))
        @rule(data=st.data(), seed=st.integers(0, 99))
        def replay(self, data, seed):
            size = data.draw(st.sampled_from(sorted(self._captured())), label="size")
            T = self._tokens(data, size)
            self._step({"do": "replay", "size": size, "mapping": self._mapping(data, T), "seed": seed}, run=True)

        def _captured(self) -> set:
            return {s["size"] for s in self.scenario.steps if s["do"] == "capture"}

        def teardown(self):
            self._flush()     # a load or capture that crashes with no forward after it is still judged

    return LayerMachine


def minimize(spec: BackendSpec, scenario: Scenario, failure: LayerFailure, device: str, executor):
    """Remove steps one at a time while the scenario still fails with the same signature (hypothesis's shrink
    of a state machine keeps steps whose removal it never tried within its limits); returns (scenario,
    failure, log) of the shortest found."""
    want = _signature(failure, scenario)
    best, best_f, log = scenario.with_steps(scenario.steps[:failure.step + 1]), failure, ""
    i = 0
    while i < len(best.steps) - 1:     # the failing (last) step stays
        trial = best.with_steps(best.steps[:i] + best.steps[i + 1:])
        if trial.problems():
            i += 1
            continue
        ex = executor.execute_scenario(spec, trial, device, 0)
        f = first_failure(spec, trial, device, ex)
        if f is not None and _signature(f, trial) == want:
            best, best_f, log = trial.with_steps(trial.steps[:f.step + 1]), f, ex.log
        else:
            i += 1
    return best, best_f, log


def fuzz_config(spec: BackendSpec, device: str) -> LayerConfig | None:
    """The configuration a layer search runs at: the device's layer shapes in the first dtype the layer claims,
    at its quant scheme and activation (harness.layer_scenarios.claimed_scenario); None if it claims none."""
    from moe_lora_harness.harness.layer_runner import layer_support
    from moe_lora_harness.harness.layer_scenarios import claimed_scenario, layer_config
    from moe_lora_harness.harness.profiles import layer_shapes_for
    shapes = layer_shapes_for(device)
    for dtype in shapes.dtypes:
        sc = claimed_scenario(spec, Scenario(layer_config(shapes, dtype)), device)
        if layer_support(spec, sc, device)[0]:
            return sc.config
    return None


def first_layer_failure(spec: BackendSpec, device: str, executor, budget_s: float, max_examples: int):
    """(the first failure's one-line summary or None, examples run, whether a configuration was claimed): the
    search without its shrink, for selftest's time to detection."""
    config = fuzz_config(spec, device)
    if config is None:
        return None, 0, False
    r = search_layer(spec, config, device, executor=executor, budget_s=budget_s, max_examples=max_examples,
                     derandomize=True, rounds=1, shrink=False)
    return (f"{r.found[0].kind}: {r.found[0].message[:120]}" if r.found else None), r.examples, True


def search_layer(spec: BackendSpec, config: LayerConfig, device: str, *, executor=None, budget_s: float | None = None,
                 max_examples: int = 50, derandomize: bool = False, database=None, rounds: int = 4,
                 shrink: bool = True) -> SearchResult:
    """Search for distinct failures: each round runs the machine until a failure (shrunk, unless `shrink` is
    False) or `max_examples`; a found failure's signature is then skipped and the search goes on, up to
    `rounds` failures."""
    executor = executor or InProcess()
    result, known, t0 = SearchResult(), [], time.monotonic()
    for _ in range(rounds):
        record: dict = {}
        deadline = None if budget_s is None else t0 + budget_s
        if deadline is not None and time.monotonic() >= deadline:
            result.exhausted = "budget"
            break
        machine = machine_for(spec, config, device, executor, known, record, deadline)
        s = settings(max_examples=max_examples, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                     derandomize=derandomize, database=database, print_blob=False, report_multiple_bugs=False,
                     verbosity=Verbosity.quiet,
                     phases=tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate),
                     suppress_health_check=list(HealthCheck))
        try:
            run_state_machine_as_test(machine, settings=s)
        except LayerFailed:
            pass
        except BudgetSpent:
            result.exhausted = "budget"
        except (Flaky, BaseExceptionGroup):   # the budget ended during the shrink (examples then run nothing):
            if "failure" not in record:         # the last failing scenario is the shrink's best so far
                raise
        result.examples += record.get("examples", 0)
        if "failure" not in record:
            result.exhausted = result.exhausted or "examples"
            break
        f, sc = record["failure"], record["scenario"]
        known.append(_signature(f, sc))
        log = ""
        if shrink:
            sc, f, log = minimize(spec, sc, f, device, executor)
        result.found.append(failed_outcome(spec, sc, device, f, log or record.get("log", ""),
                                           seconds=time.monotonic() - t0))
    result.seconds = time.monotonic() - t0
    return result
