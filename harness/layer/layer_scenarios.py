"""The named layer scenarios: `check`'s layer rows and the scripted tests of suites/layer, one table.

Each entry writes the steps that show one way a layer's state goes wrong across calls (the serving bugs of
2026: stale mappings leaking into base-model requests, LoRA paths that are not neutral for tokens without an
adapter, graphs replayed with stale metadata; adapters whose w13 and w2 differ in rank and scaling, slots reloaded
with a larger rank or after an unload, zero-token and padded replays); `layer_scenarios(device)` builds them at
the device's sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from moe_lora_harness.harness.spec.layer_contract import LayerConfig
from moe_lora_harness.harness.build.layer_scenario import Scenario
from moe_lora_harness.harness.build.layer_scenario import (forward_step as _fwd, load_step as _load,
                                                          replay_step as _replay)
from moe_lora_harness.harness.draw.profiles import LayerShapes, layer_shapes_for


def _cycle(values, n):
    return [values[i % len(values)] for i in range(n)]


@dataclass(frozen=True)
class LayerScenario:
    """A named scenario: `steps(shapes)` writes its steps; `graphs`: it captures (a layer must declare graphs)."""

    name: str
    steps: Callable[[LayerShapes], list]
    graphs: bool = False


def _adapter_then_base(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1), _fwd([0] * n, 2), _fwd([-1] * (n // 2), 3), _fwd(_cycle([-1, 0], n), 4)]


def _grow_and_shrink(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1), _load(1, s.max_rank // 2 or 1, 2), _fwd([], 3), _fwd([1], 4),
            _fwd(_cycle([0, 1, -1], n), 5), _fwd([1, -1, 0], 6), _fwd([0], 7)]


def _unload_still_mapped(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1), _load(1, s.max_rank, 2), _fwd(_cycle([0, 1, -1], n), 3),
            {"do": "unload", "slot": 0}, _fwd(_cycle([0, 1, -1, 0], n), 4)]


def _smaller_rank(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1), _fwd(_cycle([0, -1], n), 2), _load(0, 1, 3), _fwd(_cycle([0, -1], n), 4)]


def _zero_b(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1, zero_b=True), _load(1, s.max_rank, 2), _fwd(_cycle([0, 1, -1], n), 3)]


def _mapping_changes(s):
    n = s.max_tokens
    return [_load(0, s.max_rank, 1), _load(1, s.max_rank, 2), _fwd(_cycle([0, 1], n), 3),
            _fwd(_cycle([1, -1, 0], n), 4), _fwd(_cycle([-1, 1], n), 5)]


def _every_slot_then_base(s):
    n = s.max_tokens
    loads = [_load(i, max(1, s.max_rank >> i), 10 + i) for i in range(s.max_loras)]
    return [*loads, _fwd(_cycle(list(range(s.max_loras)), n), 1), _fwd([-1] * n, 2)]


def _graph_new_contents(s):
    # one capture, replayed as slots change under it: a new adapter, an unload, another adapter of a smaller rank in
    # the unloaded slot; mapped only to loaded slots or -1 (an engine that maps adapter ids cannot name an unloaded
    # one: the row "unloaded slot still in the mapping" holds that case)
    big = max(s.capture_sizes)
    return [_load(0, s.max_rank, 1), {"do": "capture", "size": big}, _replay(big, _cycle([0, -1], big), 2),
            _replay(big, _cycle([-1, 0], big - 1), 3), _load(1, s.max_rank, 4), _replay(big, _cycle([1, 0, -1], big), 5),
            {"do": "unload", "slot": 0}, _replay(big, _cycle([-1, 1], big), 6), _load(0, s.max_rank // 2 or 1, 7),
            _replay(big, _cycle([0, 1], big), 8)]


def _graph_padding(s):
    # a full batch with an adapter (replayed, then eager), then padded replays of fewer tokens: an engine that leaves
    # the padding rows' mapping as the last batch wrote it (vLLM 0.33) passes, their values being free; its real rows
    # are judged
    small, big = min(s.capture_sizes), max(s.capture_sizes)
    return [_load(0, s.max_rank, 1), {"do": "capture", "size": small}, {"do": "capture", "size": big},
            _replay(big, [0] * big, 2), _replay(big, [0, -1], 3), _replay(big, [0], 4), _replay(small, [0] * small, 5),
            _replay(big, [-1] * (big // 2), 6), _fwd([0] * big, 7), _replay(big, _cycle([-1, 0], big // 2 + 1), 8)]


def _module_ranks(s):
    # PEFT's per-expert conversion: gate_up rank 2r at alpha / 2r, down rank r at alpha / r; and the other way round
    R, n = s.max_rank, s.max_tokens
    return [_load(0, R, 1, w2_rank=R // 2 or 1, scaling=0.5, w2_scaling=1.0),
            _load(1, R // 4 or 1, 2, w2_rank=R, scaling=1.0, w2_scaling=0.125), _fwd(_cycle([0, 1, -1], n), 3)]


def _larger_rank(s):
    n = s.max_tokens
    return [_load(0, 1, 1), _load(1, s.max_rank // 2 or 1, 2, w2_rank=1), _fwd(_cycle([0, 1, -1], n), 3),
            _load(0, s.max_rank, 4), _load(1, s.max_rank, 5), _fwd(_cycle([1, 0, -1], n), 6)]


def _reload_after_unload(s):
    # mapped only to loaded slots or -1 (an engine that maps adapter ids cannot name an unloaded one)
    n, R = s.max_tokens, s.max_rank
    return [_load(0, R, 1), _load(1, R // 2 or 1, 2), _fwd(_cycle([0, 1, -1], n), 3), {"do": "unload", "slot": 0},
            _fwd(_cycle([1, -1], n), 4), _load(0, R // 2 or 1, 5), _fwd(_cycle([0, 1, -1], n), 6),
            {"do": "unload", "slot": 0}, _load(0, R // 2 or 1, 5), _fwd(_cycle([-1, 0, 1], n), 7)]


def _zero_token_replay(s):
    small, big, n = min(s.capture_sizes), max(s.capture_sizes), s.max_tokens
    return [_load(0, s.max_rank, 1), _load(1, s.max_rank // 2 or 1, 2), {"do": "capture", "size": small},
            {"do": "capture", "size": big}, _fwd(_cycle([0, 1, -1], n), 3), _replay(small, [], 4),
            _fwd(_cycle([1, 0, -1], n), 5), _replay(big, [], 6), _replay(big, _cycle([0, -1, 1], big), 7)]


SCENARIOS = (
    LayerScenario("adapter, then base-model tokens (#42008)", _adapter_then_base),
    LayerScenario("batches grow and shrink (0, 1, max_tokens, small after large)", _grow_and_shrink),
    LayerScenario("unloaded slot still in the mapping", _unload_still_mapped),
    LayerScenario("smaller rank into a used slot", _smaller_rank),
    LayerScenario("zero-B adapter beside a real one", _zero_b),
    LayerScenario("mapping changes, same batch size", _mapping_changes),
    LayerScenario("every slot, then a base-model batch", _every_slot_then_base),
    LayerScenario("graph: capture, replay with new contents and adapters", _graph_new_contents, graphs=True),
    LayerScenario("graph: a padded replay after a full batch", _graph_padding, graphs=True),
    LayerScenario("w13 and w2 of other ranks and scalings (PEFT: gate_up 2r, down r)", _module_ranks),
    LayerScenario("larger rank into a slot that held a smaller one", _larger_rank),
    LayerScenario("reload after an unload (another adapter, then the same again)", _reload_after_unload),
    LayerScenario("graph: a zero-token replay after a batch with live slots", _zero_token_replay, graphs=True),
)


def layer_config(shapes: LayerShapes, dtype: str, **overrides) -> LayerConfig:
    """The configuration the named scenarios run at (`overrides`: e.g. activation, bias)."""
    return LayerConfig(H=shapes.H, I=shapes.I, E=shapes.E, top_k=shapes.top_k, dtype=dtype,
                       max_loras=shapes.max_loras, max_rank=shapes.max_rank, max_tokens=shapes.max_tokens,
                       capture_sizes=tuple(shapes.capture_sizes), **overrides)


def claimed_scenario(spec, scenario: Scenario, device: str) -> Scenario:
    """`scenario` at a configuration `spec` claims: its own, else the first of the declared quant schemes and
    activations that makes the layer claim it (a Marlin-style layer takes quantized weights, an OAI-style one
    swigluoai), at the smallest max_rank the engine allows that holds the scenario's adapters
    (Capabilities.layer_max_ranks); the scenario unchanged when none does (its row then says why it is declined)."""
    import dataclasses
    from moe_lora_harness.harness.layer.layer_runner import layer_support
    cap = spec.capabilities
    allowed = sorted(r for r in (cap.layer_max_ranks or ()) if r >= scenario.config.max_rank)
    if cap.layer_max_ranks is not None and scenario.config.max_rank not in cap.layer_max_ranks and allowed:
        scenario = dataclasses.replace(scenario, config=dataclasses.replace(scenario.config, max_rank=allowed[0]))
    quants = ["none", *sorted(q for q in cap.quant if q != "none")]
    acts = [scenario.config.activation, *sorted(a for a in (cap.activations or ()) if a != scenario.config.activation)]
    for q in quants:
        for a in acts:   # the configuration alone (a row the steps make declined says so with its own reason)
            config = dataclasses.replace(scenario.config, quant=q, activation=a)
            if layer_support(spec, Scenario(config), device)[0]:
                return dataclasses.replace(scenario, config=config)
    return scenario


def layer_scenarios(device: str) -> list:
    """[(row name, Scenario)]: every named scenario in the device's first dtype; in each other dtype every one
    too on a GPU, the first (the #42008 sequence) on the CPU (neutrality is judged in every dtype claimed)."""
    shapes = layer_shapes_for(device)
    rows = []
    for k, dtype in enumerate(shapes.dtypes):
        for i, sc in enumerate(SCENARIOS if k == 0 or shapes.every_dtype else SCENARIOS[:1]):
            label = f"layer: {sc.name}" + ("" if k == 0 else f" [{dtype}]")
            rows.append((label, Scenario(layer_config(shapes, dtype), tuple(sc.steps(shapes)), seed=i)))
    return rows
