"""Run a layer scenario and judge every forward in order: the first failure is the outcome, reported with
the scenario cut after the failing step (a reproducer that replays alone) and its REPRO command."""
from __future__ import annotations

import dataclasses
import shlex

from moe_lora_harness.harness.spec.contract import BackendSpec, device_kind, support_for
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.execution.interpreter import cannot_run_here
from moe_lora_harness.harness.layer.layer_judge import NEUTRALITY, StepVerdict, judge_step, layer_case
from moe_lora_harness.harness.build.layer_scenario import RUNS, LayerState, Scenario
from moe_lora_harness.harness.execution.runner import MalformedCase, Outcome


def layer_support(spec: BackendSpec, scenario: Scenario, device: str) -> tuple[bool, str]:
    """(ok, reason) from the declarations alone: the layer level, the configuration's batch as an expert-level
    case (device, dtype, activation, bias, quant, rank, rules), and what the steps need (graphs, a batch of
    max_tokens, loading into a used slot)."""
    c, cap = scenario.config, spec.capabilities
    ok, why = support_for(spec, layer_case(c, c.max_tokens), device, layer=True)
    if not ok:
        return ok, why
    kinds = {s["do"] for s in scenario.steps}
    if "capture" in kinds and not cap.graphs:
        return False, "graph capture and replay not declared (Capabilities.graphs)"
    if cap.max_tokens is not None and c.max_tokens > cap.max_tokens:
        return False, f"max_tokens {c.max_tokens} > supported {cap.max_tokens}"
    if not cap.slot_reuse and _reuses_a_slot(scenario):
        return False, "loading an adapter into a slot that held another not declared (Capabilities.slot_reuse)"
    if cap.layer_max_ranks is not None and c.max_rank not in cap.layer_max_ranks:
        return False, (f"max_rank {c.max_rank} is not one the engine allows (Capabilities.layer_max_ranks: "
                       f"{sorted(cap.layer_max_ranks)})")
    if c.lora_dtype and c.lora_dtype != c.dtype and c.lora_dtype not in cap.layer_lora_dtypes:
        return False, (f"LoRA factors in {c.lora_dtype} beside {c.dtype} activations not declared "
                       f"(Capabilities.layer_lora_dtypes)")
    if not cap.maps_unloaded_slots:
        where = _maps_an_unloaded_slot(scenario)
        if where is not None:
            return False, (f"step {where} maps a token to a slot that holds no adapter, which the engine cannot "
                           f"express (Capabilities.maps_unloaded_slots)")
    return True, ""


def _maps_an_unloaded_slot(scenario: Scenario) -> int | None:
    """The first run step that maps a token to an empty slot (None: none does)."""
    loaded: set = set()
    for i, s in enumerate(scenario.steps):
        if s["do"] == "load":
            loaded.add(s["slot"])
        elif s["do"] == "unload":
            loaded.discard(s["slot"])
        elif s["do"] in RUNS and any(m >= 0 and m not in loaded for m in s["mapping"]):
            return i
    return None


def _reuses_a_slot(scenario: Scenario) -> bool:
    used = set()
    for s in scenario.steps:
        if s["do"] == "load":
            if s["slot"] in used:
                return True
            used.add(s["slot"])
    return False


def layer_repro(spec: BackendSpec, scenario: Scenario, device: str) -> str:
    """One shell command that replays this scenario alone, from any directory of a fresh shell."""
    from moe_lora_harness.harness.spec.registry import harness_command, replay_prefix
    env, backend = replay_prefix(spec)
    setup = f" --setup {shlex.quote(spec.setup)}" if isinstance(spec.setup, str) else ""
    return (f"{env}{harness_command()} replay{backend}{setup} --only {shlex.quote(spec.name)} --device {device} "
            f"--scenario {shlex.quote(scenario.to_json())}")


@dataclasses.dataclass
class LayerFailure:
    """The first failing step of a run: its index, kind, feature and message."""

    step: int
    kind: str
    feature: str
    message: str


def first_failure(spec: BackendSpec, scenario: Scenario, device: str, ex, start: int = 0,
                  state: LayerState | None = None) -> LayerFailure | None:
    """Judge the steps `start:` of an execution (ScenarioExecution) in order; `state`: the model after the steps
    before `start` (advanced in place)."""
    state = state or LayerState(scenario.config)
    previous = None        # (mapping, rows, twin rows) of the last run judged: the diagnosis reads it
    for i in range(start, len(scenario.steps)):
        step = scenario.steps[i]
        if ex.failure is not None and (ex.failed_step is None or ex.failed_step <= i):
            f = ex.failure
            what = f"{f.exc_type}: {f.message}" if f.exc_type and f.kind == "raised" else f.message
            return LayerFailure(i, f.kind, step["do"], f"step {i} ({step['do']}): {what}")
        if step["do"] in RUNS:
            rows, twin = ex.outputs[i]
            v: StepVerdict = judge_step(spec, scenario, state, step, rows, twin, device, previous)
            if not v.ok:
                return LayerFailure(i, v.kind, v.feature, f"step {i} ({step['do']}): {v.message}")
            previous = (step["mapping"], rows, twin)
        state.apply(step)
    return None


def run_scenario(spec: BackendSpec, scenario: Scenario, device: str = "cpu", *, executor=None,
                 probe: bool = False) -> Outcome:
    """Judge one scenario: unsupported (with the declared reason), not-runnable here, pass, or fail with the
    scenario cut after its first failing step, and a REPRO."""
    problems = scenario.problems()
    if problems:
        raise MalformedCase(f"malformed scenario {scenario.to_json()}: " + "; ".join(problems))
    case = layer_case(scenario.config, scenario.config.max_tokens)
    ok, reason = layer_support(spec, scenario, device)
    if not ok and not probe:
        return Outcome(spec.name, case, device, "unsupported", reason)
    ex = (executor or InProcess()).execute_scenario(spec, scenario, device, 0)
    not_here = cannot_run_here(ex.launches)
    if not_here:
        return Outcome(spec.name, case, device, "not-runnable", not_here, seconds=ex.seconds)
    failure = first_failure(spec, scenario, device, ex)
    if failure is None:
        status = "pass" if ok else "works-unclaimed"
        return Outcome(spec.name, case, device, status, "" if ok else f"declared unsupported ({reason}) but passes",
                       seconds=ex.seconds)
    if not ok:
        return Outcome(spec.name, case, device, "unsupported", reason, kind=failure.kind, message=failure.message,
                       probed=True, seconds=ex.seconds)
    return failed_outcome(spec, scenario, device, failure, ex.log, ex.seconds)


def failed_outcome(spec: BackendSpec, scenario: Scenario, device: str, failure: LayerFailure, log: str = "",
                   seconds: float = 0.0) -> Outcome:
    """The Outcome of a failing scenario: cut after its failing step, with the scenario JSON and a REPRO."""
    cut = scenario.with_steps(scenario.steps[:failure.step + 1])
    repro = layer_repro(spec, cut, device)
    lines = [f"FAIL backend={spec.name} level=layer device={device} kind={failure.kind} feature={failure.feature}",
             f"  {failure.message}"]
    if failure.feature == NEUTRALITY:
        lines.append("  (neutrality: a token without an adapter, or whose slot was unloaded, must come out bit for bit "
                     "as out of the same layer built with LoRA disabled; a replay's padding rows are free)")
    if log.strip():
        lines.append("  layer output (tail):\n    " + "\n    ".join(log.strip().splitlines()[-12:]))
    lines += [f"SCENARIO: {cut.to_json()}", f"REPRO: {repro}"]
    return Outcome(spec.name, layer_case(scenario.config, scenario.config.max_tokens), device, "fail",
                   failure.message, None, "\n".join(lines), kind=failure.kind, message=failure.message,
                   repro=repro, seconds=seconds)


