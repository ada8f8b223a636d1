"""The judge of one forward of a layer scenario: the twin is the base layer, tokens without an adapter come out
bit for bit as out of the twin (neutrality), and every row is within the error model of the float64 reference
of the adapters loaded now and the mapping given."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora_harness.harness.case import Case
from moe_lora_harness.harness.compare import compare_written, same_bits
from moe_lora_harness.harness.contract import BackendSpec
from moe_lora_harness.harness.expectation import allowances
from moe_lora_harness.harness.layer_scenario import LayerState, Scenario, base_weights, batch
from moe_lora_harness.reference.activations import is_gated
from moe_lora_harness.reference.adapters import pack_moe_lora
from moe_lora_harness.reference.experts import LoRAInputs, moe_experts_forward
from moe_lora_harness.reference.precision import bound_dtype, precision as make_precision

NEUTRALITY = "neutrality"       # the feature a not-neutral row fails
VALUES = "values"               # rows against the reference
TWIN = "twin"                   # the LoRA-disabled twin against the base reference


@dataclass
class StepVerdict:
    """A forward's verdict: ok, or the failure kind (not-neutral, element, aggregate, nonfinite, shape,
    twin-...), the feature it fails, and a message naming rows."""

    ok: bool
    kind: str = "pass"
    feature: str = ""
    message: str = ""


def layer_case(config, tokens: int) -> Case:
    """The expert-level description of one batch of a layer (what declarations and precisions are asked)."""
    return Case(level="expert", T=max(1, tokens), H=config.H, I=config.I, E=config.E, top_k=config.top_k,
                dtype=config.dtype, activation=config.activation, max_loras=config.max_loras,
                max_rank=config.max_rank, bias=config.bias, quant=config.quant, lora=config.lora_enabled)


def _expected(scenario: Scenario, state: LayerState, w, b, precision_name: str, mapping=None):
    """(truth, emulation) of a batch: base only, or with the adapters loaded now and `mapping` (judged slots)."""
    c = scenario.config
    lora_in = None
    if mapping is not None:
        stacked = pack_moe_lora(state.adapters(), max_loras=c.max_loras, max_rank=c.max_rank, num_experts=c.E,
                                hidden_size=c.H, intermediate_size=c.I, dtype=c.torch_dtype,
                                gated=is_gated(c.activation))
        lora_in = LoRAInputs(stacked, mapping)
    args = (b.hidden_states, w.w13, w.w2, b.topk_weights, b.topk_ids)
    kw = dict(activation=c.activation, w13_bias=w.w13_bias, w2_bias=w.w2_bias, lora=lora_in)
    truth = moe_experts_forward(*args, precision=make_precision("exact", None), **kw)
    emu = moe_experts_forward(*args, precision=make_precision(precision_name, c.torch_dtype), magnitudes=False, **kw)
    return truth, emu


def _values(rows, truth, emu, config, precision_name) -> StepVerdict | None:
    dt = config.torch_dtype
    written = torch.ones(rows.shape, dtype=torch.bool)
    v = compare_written(rows, truth.value, emu.value, truth.scale, written, dtype=bound_dtype(precision_name, dt),
                        k_plus_r=config.H + config.I + config.max_rank, names=("t", "h"),
                        underflow=truth.underflow, work_dtype=dt, **allowances(truth))
    return None if v.ok else StepVerdict(False, v.kind, VALUES, v.message + (f"; worst: {v.worst}" if v.worst else ""))


def _who(state: LayerState, step: dict, t: int) -> str:
    if t >= len(step["mapping"]):
        return "padding"
    s = step["mapping"][t]
    return "mapped to -1" if s < 0 else f"mapped to unloaded slot {s}"


def judge_step(spec: BackendSpec, scenario: Scenario, state: LayerState, step: dict, rows, twin_rows,
               device: str) -> StepVerdict:
    """Judge the outputs of one forward/replay step, the state being what the steps before it left."""
    c = scenario.config
    size = step.get("size", len(step["mapping"]))
    for who, r in (("layer", rows), ("LoRA-disabled twin", twin_rows)):
        if tuple(r.shape) != (size, c.H) or r.dtype != c.torch_dtype:
            return StepVerdict(False, "shape", VALUES, f"the {who} returned {tuple(r.shape)} {r.dtype}; expected "
                                                       f"({size}, {c.H}) {c.torch_dtype} for a batch of {size} tokens")
    if size == 0:
        return StepVerdict(True)
    precision_name = spec.precision_for(layer_case(c, size), device)
    w, b = base_weights(scenario, "cpu"), batch(c, step, "cpu")     # what both expectations are computed from
    twin_truth, twin_emu = _expected(scenario, state, w, b, precision_name)
    bad = _values(twin_rows, twin_truth, twin_emu, c, precision_name)
    if bad is not None:
        return StepVerdict(False, "twin-" + bad.kind, TWIN, "the LoRA-disabled twin is not the base layer: " + bad.message)
    effective = state.effective_mapping(step)
    none = effective < 0
    diff = none[:, None] & ~same_bits(rows, twin_rows)
    if diff.any():
        tokens = sorted({int(t) for t in diff.nonzero()[:, 0]})
        t = tokens[0]
        h = int(diff[t].nonzero()[0, 0])
        return StepVerdict(False, "not-neutral", NEUTRALITY,
                           f"{len(tokens)} token(s) without an adapter differ from the LoRA-disabled twin (tokens "
                           f"{tokens[:8]}); token {t} ({_who(state, step, t)}), column {h}: layer "
                           f"{float(rows[t, h]):.8g} vs twin {float(twin_rows[t, h]):.8g} "
                           f"({int(diff[t].sum())} of {c.H} columns differ)")
    truth, emu = _expected(scenario, state, w, b, precision_name, effective)
    bad = _values(rows, truth, emu, c, precision_name)
    return bad or StepVerdict(True)
