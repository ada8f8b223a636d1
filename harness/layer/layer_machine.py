"""Hypothesis's stateful testing of a layer: a rule-based state machine draws the steps (from a start with an
adapter in slot 0 and every graph captured: load adapters, replace one with another rank, unload one and reload
its slot, w13 and w2 of their own ranks and scalings, a zero-B adapter, batches of 0 to max_tokens tokens, mappings
over loaded, unloaded and -1 slots, replays at the captured sizes, zero-token ones, a full batch then a padded
replay), runs each on the live layer and its twin, and judges every forward. A failure shrinks to its shortest
step sequence: the scenario JSON and the REPRO that replays it alone.

`search_layers` is the search `fuzz` runs at the layer level (every dtype the layer claims, within one budget);
`search_layer` one configuration's, which the random test of suites/layer runs.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from hypothesis import HealthCheck, Phase, Verbosity, seed as fixed_seed, settings
from hypothesis.errors import Flaky
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.layer.layer_runner import LayerFailure, failed_outcome, first_failure
from moe_lora_harness.harness.build.layer_scenario import RUNS, LayerState, Scenario
from moe_lora_harness.harness.spec.layer_contract import LayerConfig

STEPS_PER_EXAMPLE = 12
SHRINK_SHARE = 0.5            # of the time left at a failure, what hypothesis's shrink may take (then minimize's)
SEED_STRIDE = 1000            # between the seeds of two configurations' searches (a round adds 1 to its seed)
W2_SCALINGS = (0.25, 1.0)     # a w2 module's own scaling, beside w13's (ADAPTER_SCALING, 0.5)


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


@dataclass
class Clock:
    """A search's deadline (time.monotonic; None: none), a nearer end for the phase running (`until`: hypothesis's
    shrink), and the longest a forward or replay step has taken (the layer's build counted in): work starts only
    while that many such steps still fit before the end."""

    deadline: float | None = None
    until: float | None = None
    run_s: float = 0.0

    def fits(self, runs: int) -> bool:
        ends = [t for t in (self.deadline, self.until) if t is not None]
        return not ends or time.monotonic() + self.run_s * max(1, runs) <= min(ends)

    def share(self, fraction: float) -> None:
        """End the running phase after `fraction` of the time left (no deadline: never)."""
        if self.deadline is not None and self.until is None:
            self.until = time.monotonic() + fraction * (self.deadline - time.monotonic())

    def judged(self, executor, spec, scenario: Scenario, device: str, start: int, state: LayerState | None = None):
        """(execution, first failure) of steps `start:`: executor.execute_scenario and the judge, timed together per
        run step (on a CPU the judge's float64 reference costs as much as an interpreted run: timing the run alone
        let a loaded machine overrun a 8 s budget by 60 %)."""
        t0 = time.monotonic()
        ex = executor.execute_scenario(spec, scenario, device, start)
        failure = first_failure(spec, scenario, device, ex, start, state)
        self.run_s = max(self.run_s, (time.monotonic() - t0) / max(1, _runs(scenario.steps[start:])))
        return ex, failure


def _runs(steps) -> int:
    return sum(s["do"] in RUNS for s in steps)


def _signature(failure: LayerFailure, scenario: Scenario) -> tuple:
    """(failure kind, feature, failing step kind): two failures with one signature are one bug."""
    return failure.kind, failure.feature, scenario.steps[failure.step]["do"]


def machine_for(spec: BackendSpec, config: LayerConfig, device: str, executor, known: list, record: dict,
                clock: Clock | None = None):
    """A RuleBasedStateMachine class over `spec`'s layer built for `config`, drawing only what its declarations
    allow (graphs, slot reuse, mapping unloaded slots); a failure whose signature is in `known` is not reported
    again (the example stops judging); the last failure is left in `record`; a step that no longer fits before
    `clock`'s end ends the search (BudgetSpent)."""
    L, R, cap = config.max_loras, config.max_rank, spec.capabilities
    sizes = tuple(config.capture_sizes)
    ranks = sorted({1, R // 2 or 1, R})
    clock = clock or Clock()

    def modules(data) -> dict:
        """w2's own rank and scaling, or none (w2 as w13) half of the time."""
        w2 = {"w2_rank": data.draw(st.sampled_from([None] * len(ranks) + ranks), label="w2_rank"),
              "w2_scaling": data.draw(st.sampled_from([None] * len(W2_SCALINGS) + list(W2_SCALINGS)),
                                      label="w2_scaling")}
        return {k: v for k, v in w2.items() if v is not None}

    class LayerMachine(RuleBasedStateMachine):
        @initialize(data=st.data(), seed=st.integers(0, 2**16), adapter=st.integers(0, 99),
                    rank=st.sampled_from([R, R, *ranks[:-1]]))
        def build(self, data, seed, adapter, rank):
            # as a server starts: an adapter in slot 0 (of the largest rank half the time) and every graph captured
            # (later steps replace it with another rank, unload it, load the other slots ...)
            start = [{"do": "load", "slot": 0, "rank": rank, "seed": adapter, **modules(data)}]
            start += [{"do": "capture", "size": size} for size in (sizes if cap.graphs else ())]
            self.scenario = Scenario(config, tuple(start), seed)
            self.state = LayerState(config)
            self.done = 0          # steps sent to the layer
            self.stopped = False   # a failure was found: the example judges nothing more
            record["examples"] = record.get("examples", 0) + 1
            if not clock.fits(1):   # (shrinking a failure found in time: its best so far is kept)
                raise BudgetSpent()

        def _step(self, step: dict, run: bool) -> None:
            self.scenario = self.scenario.with_steps((*self.scenario.steps, step))   # what rules may follow
            if run:                                                                    # reads the steps alone
                self._flush()

        def _flush(self) -> None:
            if self.stopped or self.done == len(self.scenario.steps):
                return
            start, self.done = self.done, len(self.scenario.steps)
            if not clock.fits(_runs(self.scenario.steps[start:])):
                raise BudgetSpent()
            ex, failure = clock.judged(executor, spec, self.scenario, device, start, self.state)
            if failure is None:
                return
            self.stopped = True
            if _signature(failure, self.scenario) in known:
                return
            record["failure"], record["scenario"], record["log"] = failure, self.scenario, ex.log
            clock.share(SHRINK_SHARE)
            raise LayerFailed(failed_outcome(spec, self.scenario, device, failure, ex.log).detail)

        def _loaded(self, now: bool) -> list:
            """The slots loaded before (now: and not unloaded since)."""
            slots: dict = {}
            for s in self.scenario.steps:
                if s["do"] == "load" or (now and s["do"] == "unload"):
                    slots[s["slot"]] = s["do"] == "load"
            return sorted(k for k, live in slots.items() if live)

        def _slot(self, data, load: bool = False) -> int:
            """A slot: one loaded before (a replacement, an unload, a reload) or any; a load into a slot never
            used when the layer does not declare slot reuse."""
            used = self._loaded(now=False)
            if load and not cap.slot_reuse:
                return data.draw(st.sampled_from(sorted(set(range(L)) - set(used))), label="slot")
            return data.draw(st.one_of(st.sampled_from(used), st.integers(0, L - 1)) if used else st.integers(0, L - 1),
                             label="slot")

        @precondition(lambda self: cap.slot_reuse or len(self._loaded(now=False)) < L)
        @rule(data=st.data(), rank=st.sampled_from(ranks), seed=st.integers(0, 99),
              zero_b=st.sampled_from([False, False, False, True]))
        def load(self, data, rank, seed, zero_b):
            step = {"do": "load", "slot": self._slot(data, load=True), "rank": rank, "seed": seed, **modules(data)}
            if zero_b:
                step["zero_b"] = True
            self._step(step, run=False)

        # replace and reload draw from `data` alone: hypothesis orders rules by their number of arguments, and its
        # derandomized first examples favour the first rules
        @precondition(lambda self: cap.slot_reuse and bool(self._loaded(now=True)))
        @rule(data=st.data())
        def replace(self, data):
            """An adapter of another rank into a live slot (a smaller one over a larger, or a larger over a smaller)."""
            slot = data.draw(st.sampled_from(self._loaded(now=True)), label="slot")
            seed = data.draw(st.integers(0, 99), label="seed")
            held = self._held(slot)
            rank = data.draw(st.sampled_from([r for r in ranks if r != max(held["rank"], held.get("w2_rank", 0))]
                                             or ranks), label="rank")
            self._step({"do": "load", "slot": slot, "rank": rank, "seed": seed}, run=False)

        def _held(self, slot: int) -> dict:
            """The last load step into `slot`."""
            return [s for s in self.scenario.steps if s["do"] == "load" and s["slot"] == slot][-1]

        @precondition(lambda self: cap.slot_reuse and bool(self._loaded(now=False)))
        @rule(data=st.data())
        def reload(self, data):
            """An adapter into a slot after an unload (a live one is unloaded first): the one it held again, or
            another."""
            slot = data.draw(st.sampled_from(self._loaded(now=False)), label="slot")
            held = self._held(slot)
            if slot in self._loaded(now=True):
                self._step({"do": "unload", "slot": slot}, run=False)
            if not data.draw(st.sampled_from([True, False]), label="same"):     # the same adapter first
                held = {"do": "load", "slot": slot, "rank": data.draw(st.sampled_from(ranks), label="rank"),
                        "seed": data.draw(st.integers(0, 99), label="seed"), **modules(data)}
            self._step(dict(held), run=False)

        @rule(data=st.data())
        def unload(self, data):
            self._step({"do": "unload", "slot": self._slot(data)}, run=False)

        def _tokens(self, data, most: int) -> int:
            """A batch size: 0, 1, the largest, the last batch's again (a stale tail shows then), or any."""
            last = [len(s["mapping"]) for s in self.scenario.steps if s["do"] in RUNS][-1:]
            fixed = sorted({0, 1, most, *[t for t in last if t <= most]})
            return data.draw(st.one_of(st.sampled_from(fixed), st.integers(0, most)), label="tokens")

        def _mapping(self, data, T: int) -> list:
            """Per-token slots (a loaded slot or -1 more often than any slot; only those when the layer cannot map
            an unloaded slot), or one slot for all (-1: a base-model batch)."""
            if cap.maps_unloaded_slots:
                slot = st.one_of(st.sampled_from([-1, *self._loaded(now=False)]), st.integers(-1, L - 1))
            else:
                slot = st.sampled_from([-1, *self._loaded(now=True)])
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

        @precondition(lambda self: bool(self._captured()))
        @rule(data=st.data(), seed=st.integers(0, 99))
        def dummy_replay(self, data, seed):
            """A replay with no real token (a data-parallel rank's dummy batch at a captured size)."""
            size = data.draw(st.sampled_from(sorted(self._captured())), label="size")
            self._step({"do": "replay", "size": size, "mapping": [], "seed": seed}, run=True)

        @precondition(lambda self: bool(self._loaded(now=True)) and max(self._captured(), default=0) > 1)
        @rule(data=st.data(), seed=st.integers(0, 99))
        def padded_after_full(self, data, seed):
            """A full batch of a captured size, every token with an adapter, then a replay of fewer tokens at that
            size (a faithful layer's padding rows may keep the full batch's slots; they must not reach a real row)."""
            size = data.draw(st.sampled_from(sorted(s for s in self._captured() if s > 1)), label="size")
            full = data.draw(st.lists(st.sampled_from(self._loaded(now=True)), min_size=size, max_size=size),
                             label="full")
            self._step({"do": "forward", "mapping": full, "seed": seed}, run=True)
            T = data.draw(st.integers(1, size - 1), label="tokens")
            self._step({"do": "replay", "size": size, "mapping": self._mapping(data, T), "seed": seed + 1}, run=True)

        def _captured(self) -> set:
            return {s["size"] for s in self.scenario.steps if s["do"] == "capture"}

        def teardown(self):
            self._flush()     # a load or capture that crashes with no forward after it is still judged

    return LayerMachine


def minimize(spec: BackendSpec, scenario: Scenario, failure: LayerFailure, device: str, executor,
             clock: Clock | None = None):
    """The shortest scenario found that still fails with the same signature: first without every step no later
    step needs (`unneeded`), then removing steps one at a time (hypothesis's shrink of a state machine keeps steps
    whose removal it never tried within its limits), while a run still fits before `clock`'s deadline; returns
    (scenario, failure, log)."""
    want, clock = _signature(failure, scenario), clock or Clock()
    best = (scenario.with_steps(scenario.steps[:failure.step + 1]), failure, "")

    def fails(steps) -> bool:
        nonlocal best
        trial = best[0].with_steps(steps)
        if trial.problems() or not clock.fits(_runs(steps)):
            return False
        ex, f = clock.judged(executor, spec, trial, device, 0)
        if f is None or _signature(f, trial) != want:
            return False
        best = (trial.with_steps(trial.steps[:f.step + 1]), f, ex.log)
        return True

    def drop_unneeded() -> bool:
        drop = unneeded(best[0].steps)
        return bool(drop) and fails([s for i, s in enumerate(best[0].steps) if i not in drop])

    def one_at_a_time() -> None:
        i = 0
        while i < len(best[0].steps) - 1 and clock.fits(_runs(best[0].steps)):   # the failing (last) step stays
            steps = best[0].steps
            if not fails(steps[:i] + steps[i + 1:]):
                i += 1

    drop_unneeded()
    one_at_a_time()
    while drop_unneeded():     # a removal may leave a step unneeded (a capture whose replay went)
        one_at_a_time()
    return best


def unneeded(steps) -> set:
    """The indices of the steps no later step needs: a capture whose size no later replay runs at, a load or an
    unload whose slot no later forward or replay maps."""
    out, sizes, slots = set(), set(), set()
    for i in range(len(steps) - 1, -1, -1):
        s = steps[i]
        if s["do"] in RUNS:
            slots.update(m for m in s["mapping"] if m >= 0)
            if s["do"] == "replay":
                sizes.add(s["size"])
        elif s["do"] == "capture" and s["size"] not in sizes \
                or s["do"] in ("load", "unload") and s["slot"] not in slots:
            out.add(i)
    return out


def fuzz_configs(spec: BackendSpec, device: str) -> list:
    """The configurations a layer search runs at: the device's layer shapes in each dtype the layer claims, at
    its quant scheme and activation (harness.layer.layer_scenarios.claimed_scenario); [] if it claims none."""
    from moe_lora_harness.harness.layer.layer_runner import layer_support
    from moe_lora_harness.harness.layer.layer_scenarios import claimed_scenario, layer_config
    from moe_lora_harness.harness.draw.profiles import layer_shapes_for
    shapes = layer_shapes_for(device)
    claimed = (claimed_scenario(spec, Scenario(layer_config(shapes, dtype)), device) for dtype in shapes.dtypes)
    return [sc.config for sc in claimed if layer_support(spec, sc, device)[0]]


def fuzz_config(spec: BackendSpec, device: str) -> LayerConfig | None:
    """The first of fuzz_configs (the device's first dtype the layer claims), or None."""
    return next(iter(fuzz_configs(spec, device)), None)


def first_layer_failure(spec: BackendSpec, device: str, executor, budget_s: float, max_examples: int):
    """(the first failure's one-line summary or None, examples run, whether a configuration was claimed): the
    search of every claimed dtype without its shrink, for selftest's time to detection."""
    configs = fuzz_configs(spec, device)
    r = search_layers(spec, configs, device, executor=executor, budget_s=budget_s, max_examples=max_examples,
                      derandomize=True, rounds=1, shrink=False, first=True)
    return (f"{r.found[0].kind}: {r.found[0].message[:120]}" if r.found else None), r.examples, bool(configs)


def search_layers(spec: BackendSpec, configs: list, device: str, *, budget_s: float | None = None,
                  max_examples: int = 50, first: bool = False, seed: int | None = None, derandomize: bool = False,
                  **kw) -> SearchResult:
    """search_layer over each configuration in turn (every dtype a layer claims), the budget and the examples
    shared evenly (what one leaves goes to the next), each with its own draws (configuration k: seed + k *
    SEED_STRIDE; derandomized, k > 0: seed k * SEED_STRIDE); a failure found in one is not reported again in
    another; `first`: stop at the first failure."""
    result, known, t0 = SearchResult(), [], time.monotonic()
    for k, config in enumerate(configs):
        kw["seed"] = seed + k * SEED_STRIDE if seed is not None else k * SEED_STRIDE if derandomize and k else None
        share = len(configs) - k
        left = None if budget_s is None else budget_s - (time.monotonic() - t0)
        if left is not None and left <= 0:
            result.exhausted = "budget"
            break
        r = search_layer(spec, config, device, budget_s=None if left is None else left / share,
                         max_examples=max(1, math.ceil((max_examples - result.examples) / share)),
                         derandomize=derandomize, known=known, **kw)
        result.found += r.found
        result.examples += r.examples
        result.exhausted = r.exhausted
        if first and r.found:
            break
    result.seconds = time.monotonic() - t0
    return result


def search_layer(spec: BackendSpec, config: LayerConfig, device: str, *, executor=None, budget_s: float | None = None,
                 max_examples: int = 50, derandomize: bool = False, seed: int | None = None, database=None,
                 rounds: int = 4, shrink: bool = True, known: list | None = None) -> SearchResult:
    """Search for distinct failures: each round runs the machine until a failure (shrunk, unless `shrink` is
    False) or `max_examples`; a found failure's signature is then skipped (added to `known`) and the search goes
    on, up to `rounds` failures. `seed`: hypothesis's seed (round k: seed + k); the budget holds the shrink too."""
    executor = executor or InProcess()
    known = [] if known is None else known
    t0 = time.monotonic()
    result, clock = SearchResult(), Clock(None if budget_s is None else t0 + budget_s)
    for k in range(rounds):
        record: dict = {}
        if not clock.fits(1):
            result.exhausted = "budget"
            break
        machine = machine_for(spec, config, device, executor, known, record, clock)
        if seed is not None:
            machine = fixed_seed(seed + k)(machine)
        s = settings(max_examples=max_examples, stateful_step_count=STEPS_PER_EXAMPLE, deadline=None,
                     derandomize=derandomize, database=database, print_blob=False, report_multiple_bugs=False,
                     verbosity=Verbosity.quiet,
                     phases=tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate),
                     suppress_health_check=list(HealthCheck))
        try:
            run_state_machine_as_test(machine, settings=s)
        except LayerFailed:
            pass
        except BudgetSpent:   # the budget or the shrink's share ended (the last failing scenario is its best so far)
            result.exhausted = result.exhausted if "failure" in record else "budget"
        except (Flaky, BaseExceptionGroup):   # a failure the shrink could not replay: the one recorded stands
            if "failure" not in record:
                raise
        clock.until = None
        result.examples += record.get("examples", 0)
        if "failure" not in record:
            result.exhausted = result.exhausted or "examples"
            break
        f, sc = record["failure"], record["scenario"]
        known.append(_signature(f, sc))
        log = ""
        if shrink:
            sc, f, log = minimize(spec, sc, f, device, executor, clock)
        result.found.append(failed_outcome(spec, sc, device, f, log or record.get("log", ""),
                                           seconds=time.monotonic() - t0))
    result.seconds = time.monotonic() - t0
    return result
