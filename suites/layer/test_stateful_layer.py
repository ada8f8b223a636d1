"""Our stateful layer through the layer contract (CPU interpreter, tiny shapes), judged by the harness's layer
runner: outputs within the float64 reference's bound for the adapters loaded, tokens without an adapter
bit-identical to the LoRA-disabled twin, replay equal to forward, what it refuses, and every planted layer
mutant caught on its scenario, as the kind its mechanism shows, while its control passes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_lora_harness.backends.layer import LAYER_DUAL_STREAM, LAYER_MARLIN, LAYER_OAI, LAYER_TRITON
from moe_lora_harness.harness.judge.compare import same_bits
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.spec.layer_contract import LayerBatch, LayerConfig, LayerWeights
from moe_lora_harness.harness.layer.layer_runner import run_scenario as run_layer_scenario
from moe_lora_harness.harness.build.layer_scenario import Scenario, base_weights
from moe_lora_harness.harness.build.layer_scenario import adapter as scenario_adapter, batch as scenario_batch
from moe_lora_harness.reference.adapters import ExpertAdapter
from moe_lora_harness.suites.layer.layer_mutants import (
    CONTROL, CONTROL_FOR, MECHANISMS, MUTANTS, SCENARIOS, SHOWS, UNPADDED)

CONTROLS = {s.name: s for s in (*CONTROL, UNPADDED)}
KINDS_SHOWN = {   # what layer_mutants.SHOWS says -> the harness's failure kinds
    "not-neutral": lambda p: p.startswith("not-neutral:"),
    "out-of-bound": lambda p: p.split(":")[0] in ("element", "aggregate"),
    "raises ScheduleError": lambda p: p.startswith("raised:") and "ScheduleError" in p,
}


def config(dtype="float32", device="cpu", **kw) -> LayerConfig:
    base = dict(H=32, I=32, E=4, top_k=2, dtype=dtype, max_loras=2, max_rank=8, max_tokens=8, capture_sizes=(4, 8))
    return LayerConfig(device=device, **{**base, **kw})


def weights(c: LayerConfig) -> LayerWeights:
    """The base weights a scenario of `c` builds (harness.build.layer_scenario.base_weights), on c's device."""
    return base_weights(Scenario(dataclasses.replace(c, device="cpu")), c.device)


def adapter(c: LayerConfig, rank: int, seed: int) -> ExpertAdapter:
    return scenario_adapter(c, {"rank": rank, "seed": seed})


def batch(c: LayerConfig, size: int, seed: int) -> LayerBatch:
    return scenario_batch(c, {"mapping": [-1] * size, "seed": seed}, c.device)


def run_steps(spec, steps, c: LayerConfig | None = None) -> list:
    """The harness's verdict (harness.layer.layer_runner) on `steps` at config `c`: [] when every forward passes, else
    the failure's kind and message."""
    sc = Scenario(dataclasses.replace(c or config(), device="cpu"), tuple(steps))
    o = run_layer_scenario(spec, sc, (c or config()).device, executor=InProcess())
    if o.status == "unsupported":
        pytest.skip(o.reason)
    return [] if o.status == "pass" else [f"{o.kind}: {o.message}"]


MIXED = [{"do": "load", "slot": 0, "rank": 8, "seed": 1}, {"do": "load", "slot": 1, "rank": 3, "seed": 2},
         {"do": "forward", "mapping": [0, -1, 1, -1, 0, 1], "seed": 3},
         {"do": "capture", "size": 8},
         {"do": "replay", "size": 8, "mapping": [1, -1, 0, 0, -1], "seed": 4},
         {"do": "unload", "slot": 0}, {"do": "load", "slot": 1, "rank": 5, "seed": 5},
         {"do": "replay", "size": 8, "mapping": [0, 1, -1, 1, 0, 0, 1, -1], "seed": 6}]


def on_device(c: LayerConfig):
    """Skip what our kernels decline on this device (bf16 in the CPU interpreter), with the declared reason."""
    from moe_lora_harness.backends.layer import moe_config
    from moe_lora_harness.kernels.experts.triton_experts import TritonExperts
    ok, why = TritonExperts.is_supported_config(moe_config(c))
    if not ok:
        pytest.skip(why)
    return c


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec", [LAYER_TRITON, LAYER_DUAL_STREAM], ids=lambda s: s.name)
def test_layer_matches_reference_and_twin(spec, dtype, device):
    """Loads, a forward, a padded replay, an unload and a smaller rank reloaded over a used slot."""
    assert run_steps(spec, MIXED, on_device(config(dtype, device))) == []


def test_replay_equals_forward_on_the_same_contents(device):
    c = config(device=device)
    w = weights(c)
    layer = LAYER_TRITON.layer(c, LayerWeights(w.w13, w.w2))
    layer.load_adapter(0, adapter(c, 8, 1))
    layer.capture(8)
    b = batch(c, 8, 7)
    layer.set_mapping(torch.tensor([0, -1, 0, 0, -1], dtype=torch.int32, device=device))
    replayed = layer.replay(b)
    layer.set_mapping(torch.tensor([0, -1, 0, 0, -1, -1, -1, -1], dtype=torch.int32, device=device))
    assert bool(same_bits(replayed, layer.forward(b)).all())


def test_layer_refuses_what_it_cannot_run(device):
    c = config(device=device)
    w = weights(c)
    w = LayerWeights(w.w13, w.w2)
    with pytest.raises(ValueError, match="swiglu_alpha"):
        LAYER_OAI.layer(config(activation="swigluoai", swiglu_alpha=1.0, device=device), w)
    with pytest.raises(ValueError, match="declines"):
        LAYER_MARLIN.layer(c, w)          # no quant scheme: Marlin declines it
    layer = LAYER_TRITON.layer(c, w)
    with pytest.raises(ValueError, match="rank"):
        layer.load_adapter(0, adapter(c, 9, 1))
    with pytest.raises(ValueError, match="set_mapping|mapping"):
        layer.forward(batch(c, 3, 1))
    twin = LAYER_TRITON.layer(c.twin(), w)
    with pytest.raises(RuntimeError, match="LoRA disabled"):
        twin.load_adapter(0, adapter(c, 2, 1))


@pytest.mark.parametrize("spec, kw", [
    (LAYER_OAI, dict(activation="swigluoai", bias=True)),
    (LAYER_MARLIN, dict(dtype="float16", quant="int8_channel")),
    (LAYER_TRITON, dict(activation="gelu_no_mul", intermediate_padded=48)),
], ids=["oai", "marlin-int8", "triton-nongated-padded"])
def test_other_experts_and_configs(spec, kw, device):
    steps = [{"do": "load", "slot": 1, "rank": 4, "seed": 1}, {"do": "forward", "mapping": [1, -1, 1, 0], "seed": 2}]
    assert run_steps(spec, steps, config(device=device, **kw)) == []


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda s: s.name)
def test_mutant_caught_and_its_control_passes(mutant, device):
    steps, c = SCENARIOS[mutant.name], config(device=device)
    if device != "cpu" and SHOWS[mutant.name].startswith("raises"):
        pytest.skip("a race the CPU Recorder reports; on a GPU it shows only when the streams happen to interleave")
    assert mutant.name in MECHANISMS and mutant.origin.endswith(":MUTANTS")
    assert run_steps(CONTROLS[CONTROL_FOR[mutant.name]], steps, c) == []
    found = run_steps(mutant, steps, c)
    assert any(KINDS_SHOWN[SHOWS[mutant.name]](p) for p in found), \
        f"{mutant.name} ({MECHANISMS[mutant.name]}) is not caught as {SHOWS[mutant.name]}: {found}"
