"""The layer side of a scenario run: build the layer and its LoRA-disabled twin, drive both through the
steps, hand back every output as CPU data (in the supervised worker, or in the caller's process). The weights,
batches and mappings are handed over between guard bands (harness.build.guards); adapters are handed over as a
checkpoint is loaded, on the CPU, unguarded.

One live session is kept per process, so a search that extends a scenario step by step runs only the new
steps (a request whose earlier steps differ from the live session's starts a new layer and replays them).
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass, field

from moe_lora_harness.harness.build.guards import guard_calls, guard_fields, outside_message, written_outside
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.harness.execution.execute import Failure, HarnessInterrupt, _FATAL_DEVICE_ERROR, run_setup
from moe_lora_harness.harness.execution.interpreter import LaunchWatch
from moe_lora_harness.harness.spec.layer_contract import missing_methods
from moe_lora_harness.harness.build.layer_scenario import Scenario, adapter, base_weights, batch, mapping, on_cpu


@dataclass
class ScenarioExecution:
    """What the steps from `start` produced: (layer rows, twin rows) per forward/replay step index, CPU
    tensors; or the failure of step `failed_step` (None: building the layer)."""

    outputs: dict = field(default_factory=dict)
    failure: Failure | None = None
    failed_step: int | None = None
    seconds: float = 0.0
    log: str = ""
    launches: list = field(default_factory=list)


def session_key(spec: BackendSpec, scenario: Scenario, device: str) -> tuple:
    """What a live layer was built for: a request with another key gets a new layer."""
    return spec.origin, spec.name, device, scenario.config, scenario.seed


class BandsWritten(Exception):
    """A step wrote outside the tensors it was handed (the guard bands around them, harness.build.guards)."""


class _Session:
    def __init__(self, spec: BackendSpec, scenario: Scenario, device: str):
        config = dataclasses.replace(scenario.config, device=device)
        # the weights lie between guard bands for the layer's whole life (it keeps them), each batch and mapping for
        # its step's: a read past an end brings NaN into an output, a write past one fails the step that made it
        (weights,), self._bands = guard_calls([base_weights(scenario, device)], ["weights."])
        self.key = session_key(spec, scenario, device)
        self._config = config
        self.steps: list = []
        self.layer = spec.layer(config, weights)
        self.twin = spec.layer(config.twin(), weights)
        for who, obj in (("layer", self.layer), ("twin", self.twin)):
            gone = missing_methods(obj, spec.capabilities.graphs)
            if gone:
                raise TypeError(f"the {who} that {spec.name}'s factory built lacks the layer contract's "
                                f"method(s) {gone} (harness.spec.layer_contract)")

    def run(self, step: dict, device: str):
        kind, c = step["do"], self.layer
        out, step_bands = None, []
        if kind == "load":
            c.load_adapter(step["slot"], on_cpu(adapter(self._config, step, device)))
        elif kind == "unload":
            c.unload_adapter(step["slot"])
        elif kind == "capture":
            c.capture(step["size"])
            _twin(self.twin.capture, step["size"])
        else:
            (b,), batch_bands = guard_calls([batch(self._config, step, device)], ["batch."])
            (m,), mapping_bands = guard_fields([{"mapping": mapping(step, device)}], [""])
            c.set_mapping(m["mapping"])
            call = c.forward if kind == "forward" else c.replay
            rows = _cpu(call(b))
            out = (rows, _cpu(_twin(self.twin.forward if kind == "forward" else self.twin.replay, b)))
            step_bands = batch_bands + mapping_bands      # read after this step (a later one has its own)
        written = written_outside(self._bands + step_bands)
        if written:
            raise BandsWritten(outside_message("the layer", written, "each step"))
        self.steps.append(step)
        return out


def _twin(fn, *args):
    try:
        return fn(*args)
    except HarnessInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        raise RuntimeError(f"the LoRA-disabled twin raised {type(e).__name__}: {e}") from e


def _cpu(t):
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a forward/replay must return a torch.Tensor of shape (tokens, H); got {type(t).__name__}")
    return t.detach().to("cpu").clone()


_LIVE: dict = {}


def execute_scenario(spec: BackendSpec, scenario: Scenario, device: str, start: int = 0) -> ScenarioExecution:
    """Run `scenario.steps[start:]` on a layer that has run `steps[:start]` (the live one when it has, else a
    new one that replays them first); any exception of the backend becomes the failure of its step."""
    t0 = time.perf_counter()
    setup_failure = run_setup(spec)
    if setup_failure is not None:
        return ScenarioExecution(failure=setup_failure, seconds=time.perf_counter() - t0)
    steps = list(scenario.steps)
    live = _LIVE.get("session")
    key = session_key(spec, scenario, device)
    result = ScenarioExecution()
    watch = LaunchWatch()
    index = None
    try:
        with watch:
            if live is None or live.key != key or live.steps != steps[:len(live.steps)] or len(live.steps) > start:
                _LIVE.pop("session", None)
                live = _LIVE["session"] = _Session(spec, scenario, device)
            for index in range(len(live.steps), len(steps)):
                out = live.run(steps[index], device)
                if out is not None and index >= start:
                    result.outputs[index] = out
    except BaseException as e:  # noqa: BLE001 - whatever a layer raises is its failure, never our exit
        if isinstance(e, HarnessInterrupt):
            raise
        _LIVE.pop("session", None)
        msg = f"{e}"
        result.failure = Failure("outside-written" if isinstance(e, BandsWritten) else "raised", msg[:4000],
                                 type(e).__name__,
                                 "".join(traceback.format_exception(e)[-6:])[-6000:],
                                 fatal=bool(_FATAL_DEVICE_ERROR.search(msg)))
        result.failed_step = index
    result.seconds = time.perf_counter() - t0
    result.launches = watch.launches
    return result


def forget_live() -> None:
    """Drop the live session (a test that needs a fresh layer)."""
    _LIVE.pop("session", None)
