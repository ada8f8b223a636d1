"""The judge of one forward of a layer scenario: the twin is the base layer, tokens without an adapter come out
bit for bit as out of the twin (neutrality), and every row is within the error model of the float64 reference
of the adapters loaded now and the mapping given."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moe_lora_harness.harness.build.builders import build_device
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written, format_worst, same_bits
from moe_lora_harness.harness.spec.contract import BackendSpec
from moe_lora_harness.harness.judge.expectation import Rules
from moe_lora_harness.harness.layer.layer_diagnosis import StepContext, explain
from moe_lora_harness.harness.build.layer_scenario import LayerState, Scenario, base_weights, batch, on_cpu
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


def _expected(scenario: Scenario, state: LayerState, w, b, precision_name: str, mapping=None, adapters=None):
    """(truth, emulation) of a batch: base only, or with the adapters loaded now (`adapters`: others) and `mapping`
    (judged slots). Computed where `w` and `b` are (a CUDA run's GPU: the float64 GEMMs of a LARGE_LAYER step took
    seconds on a loaded CPU), handed back on the CPU, where the rows are judged."""
    c = scenario.config
    at = w.w13.device
    lora_in = None
    if mapping is not None:
        stacked = pack_moe_lora(state.adapters(at) if adapters is None else adapters, max_loras=c.max_loras,
                                max_rank=c.max_rank, num_experts=c.E, hidden_size=c.H, intermediate_size=c.I,
                                dtype=c.lora_torch_dtype, gated=is_gated(c.activation), device=at)
        lora_in = LoRAInputs(stacked, mapping.to(at))
    args = (b.hidden_states, w.w13, w.w2, b.topk_weights, b.topk_ids)
    kw = dict(activation=c.activation, w13_bias=w.w13_bias, w2_bias=w.w2_bias, lora=lora_in)
    truth = moe_experts_forward(*args, precision=make_precision("exact", None), **kw)
    emu = moe_experts_forward(*args, precision=make_precision(precision_name, c.torch_dtype), magnitudes=False, **kw)
    return on_cpu(truth), on_cpu(emu)


@functools.lru_cache(maxsize=1)
def _base_weights(config, seed: int, at: torch.device):
    """A scenario's base weights on `at`, drawn once per scenario (not per judged step: drawing and moving them took
    0.8 s of each step's 1.5 s at LARGE_LAYER on the H200); the last scenario's are kept."""
    return base_weights(Scenario(config, (), seed), at)


def _compare(rows, truth, emu, config, precision_name, real: int, rules: Rules = Rules()):
    """compare_written over rows [0, real) (padding rows beyond are free) under `rules` (expectation.Rules: its
    groups, each row's judged slot, for rule 4 per slot; its points_only, the layer's BackendSpec.model_points_only)."""
    dt = config.torch_dtype
    written = torch.zeros(rows.shape, dtype=torch.bool)
    written[:real] = True
    return compare_written(rows, truth.value, emu.value, truth.scale, written, dtype=bound_dtype(precision_name, dt),
                           k_plus_r=k_plus_r(config), names=("t", "h"), underflow=truth.underflow, work_dtype=dt,
                           **rules.kwargs(truth))


def k_plus_r(config) -> int:
    return config.H + config.I + config.max_rank


def _failed(kind_prefix: str, feature: str, head: str, v, ctx: StepContext, truth, emu, dtype) -> StepVerdict:
    """A value failure's verdict: the judge's message, the worst elements (labelled, with their rows' slots), and
    the diagnosis (harness.layer.layer_diagnosis)."""
    slot = lambda idx: f"slot {int(ctx.effective[idx[0]])}" if int(ctx.effective[idx[0]]) >= 0 else "no adapter"  # noqa: E731
    lines = [head + v.message]
    if v.worst:
        lines.append("worst elements (t: token row, h: hidden column):\n" + format_worst(v, ("t", "h"), coords=slot))
    lines += explain(ctx, truth, emu, dtype, v.kind)
    return StepVerdict(False, kind_prefix + v.kind, feature, "\n  ".join(lines))


def _who(state: LayerState, step: dict, t: int) -> str:
    if t >= len(step["mapping"]):
        return "padding"
    s = step["mapping"][t]
    return "mapped to -1" if s < 0 else f"mapped to unloaded slot {s}"


def judge_step(spec: BackendSpec, scenario: Scenario, state: LayerState, step: dict, rows, twin_rows,
               device: str, previous: tuple | None = None) -> StepVerdict:
    """Judge the outputs of one forward/replay step, the state being what the steps before it left; `previous`:
    (mapping, rows, twin rows) of the run before it (the diagnosis reads the side it judges)."""
    c = scenario.config
    size = step.get("size", len(step["mapping"]))
    for who, r in (("layer", rows), ("LoRA-disabled twin", twin_rows)):
        if tuple(r.shape) != (size, c.H) or r.dtype != c.torch_dtype:
            return StepVerdict(False, "shape", VALUES, f"the {who} returned {tuple(r.shape)} {r.dtype}; expected "
                                                       f"({size}, {c.H}) {c.torch_dtype} for a batch of {size} tokens")
    real = len(step["mapping"])          # rows beyond are a replay's padding: their values are free
    if real == 0:
        return StepVerdict(True)
    precision_name = spec.precision_for(layer_case(c, size), device)
    w = _base_weights(c, scenario.seed, build_device(device))  # the expectations' device: a CUDA run's GPU, else
    at = w.w13.device                                           # the CPU; spelt as _expected spells it (the
    b = batch(c, step, at)                                      # state's adapters are drawn once per spelling)
    effective = state.effective_mapping(step)
    points_only = spec.model_points_only_for(device)

    def expected(mapping, adapters=None, precision=None):
        return _expected(scenario, state, w, b, precision or precision_name, mapping, adapters)

    def rules(slots=None):
        return Rules(device, points_only, slots)

    def judge(r, truth, emu, name, slots=None):
        return _compare(r, truth, emu, c, name, real, rules(slots))

    def context(r, slots, adapters, twin=False):
        prev = None if previous is None else (previous[0], previous[2] if twin else previous[1])
        return StepContext(r, real, slots, adapters, expected, precision_name, judge, k_plus_r(c), prev,
                           rules(None if twin else slots))

    twin_truth, twin_emu = expected(None)
    v = judge(twin_rows, twin_truth, twin_emu, precision_name)
    if not v.ok:
        none = torch.full_like(effective, -1)
        return _failed("twin-", TWIN, "the LoRA-disabled twin is not the base layer: ", v,
                       context(twin_rows, none, [None] * c.max_loras, twin=True), twin_truth, twin_emu,
                       c.torch_dtype)
    none = effective < 0
    none[real:] = False
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
    truth, emu = expected(effective)
    v = judge(rows, truth, emu, precision_name, effective)
    if not v.ok:
        return _failed("", VALUES, "", v, context(rows, effective, state.adapters(at)), truth, emu, c.torch_dtype)
    return StepVerdict(True)
