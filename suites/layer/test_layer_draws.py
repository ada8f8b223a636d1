"""A scenario's tensors: drawn where the run draws (a GPU run on its GPU, as the expert-level builders draw), the
CPU's values unchanged, a layer handed its adapters on the CPU, and the judge's state drawing each loaded adapter
once (it reads them at every judged step)."""
from __future__ import annotations

import dataclasses
import math

import torch

from moe_lora_harness.harness.build.builders import build_device
from moe_lora_harness.harness.build.layer_scenario import LayerState, Scenario, adapter, base_weights, on_cpu
from moe_lora_harness.harness.layer.layer_scenarios import layer_config
from moe_lora_harness.harness.draw.profiles import SMALL_LAYER

CONFIG = layer_config(SMALL_LAYER, "float32")
LOAD = {"do": "load", "slot": 0, "rank": 4, "seed": 5}


def _factors(a):
    return {f.name: v for f in dataclasses.fields(a) for v in [getattr(a, f.name)] if isinstance(v, torch.Tensor)}


def test_the_cpu_draws_what_it_always_drew():
    """On the CPU the base weights are one float64 draw of the scenario's generator (the values every recorded
    scenario was judged with)."""
    c = CONFIG
    g = torch.Generator().manual_seed(7 * 1_000_003 + 1)
    w13 = (torch.randn(c.E, 2 * c.I, c.H, generator=g, dtype=torch.float64) / math.sqrt(c.H)).to(c.torch_dtype)
    assert torch.equal(base_weights(Scenario(c, (), 7), "cpu").w13, w13)


def test_draws_land_where_the_run_draws(device):
    """Base weights and adapters on build_device(device), the same on every draw; the layer's copy (on_cpu) holds
    the same values on the CPU."""
    at = build_device(device)
    w = base_weights(Scenario(CONFIG, (), 3), device)
    assert w.w13.device.type == at.type and torch.equal(w.w13, base_weights(Scenario(CONFIG, (), 3), device).w13)
    a = adapter(CONFIG, LOAD, device)
    cpu = on_cpu(a)
    for name, t in _factors(a).items():
        assert t.device.type == at.type, name
        assert _factors(cpu)[name].device.type == "cpu" and torch.equal(_factors(cpu)[name], t.cpu()), name


def test_the_state_draws_each_loaded_adapter_once():
    """The judge's state keeps a slot's adapter from its load to the next load or unload of that slot (and only
    that slot's)."""
    state = LayerState(CONFIG)
    state.apply(LOAD)
    state.apply({**LOAD, "slot": 1, "seed": 6})
    first = state.adapters()
    assert first[0] is state.adapters()[0] and first[1] is state.adapters()[1]
    state.apply({**LOAD, "seed": 9})
    again = state.adapters()
    assert again[1] is first[1] and again[0] is not first[0]
    assert not torch.equal(again[0].gate_a, first[0].gate_a)
    state.apply({"do": "unload", "slot": 0})
    assert state.adapters()[0] is None and state.adapters()[1] is first[1]
