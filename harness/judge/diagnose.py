"""Precision diagnosis: which rounding model a failing kernel's output follows, or that none does.

A bound failure that is not gross is re-judged against the reference's alternative rounding models
(reference.precision.VARIANTS); the nearest that passes and shares most of its error is named.
docs/error-model.md ("Precision diagnosis") gives the two statistics and why the thresholds are what they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.build.builders import build_op_inputs, torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import RATIO, compare_written
from moe_lora_harness.harness.judge.expectation import Rules, judging, op_reference
from moe_lora_harness.harness.build.expert_runner import expert_expectations
from moe_lora_harness.reference.precision import (ACC_TILE, PRESETS, VARIANTS, bound_dtype, compose, precision,
                                                   split_name)

GROSS_REL = 2.0 ** -5      # worst |out - truth| / scale above this: a gross (semantic) error, not diagnosed
MATCH_DISTANCE = 2 ** -0.5  # a model matches an output this near its emulation (docs/error-model.md)
MARGIN = 0.5               # ... and at most this fraction of its distance from the declared model's emulation

_DIAGNOSED_KINDS = ("element", "aggregate")


@dataclass
class ModelFit:
    """One rounding model against the output: `ratio` (verdict statistic), `distance` (to its emulation)."""

    name: str
    description: str
    ratio: float
    distance: float
    passes: bool


@dataclass
class Diagnosis:
    """The best-matching rounding model (None: no model explains the failure) and the declared one."""

    model: str | None
    description: str
    ratio: float                 # aggregate ratio against the matched model (or the nearest, without a match)
    distance: float
    declared: str
    declared_ratio: float
    declared_distance: float
    worst_rel: float             # worst |out - truth| / scale over the written elements
    text: str
    fits: list = field(default_factory=list)   # every ModelFit tried, nearest first (declared included)

    @property
    def matched(self) -> bool:
        return self.model is not None


def describe(name: str) -> str:
    """Words for a preset name: 'TF32 operands' for one_shot_tf32, 'one_shot roundings' for one_shot."""
    path, variants = split_name(name)
    if not variants:
        return f"{path} roundings"
    words = {"tf32": "TF32 operands", "tf32rz": "truncated TF32 operands", "bf16ops": "bf16 operands",
             "rankraw": "rank intermediate not rounded",
             "rank2x": "rank intermediate rounded twice", "fp16acc": "fp16 accumulation",
             "out2x": "output rounded twice", "outacc": "expand summed onto the output",
             "dtacc": f"accumulator in the working dtype between K tiles of {ACC_TILE}"}
    return " + ".join(words[v] for v in variants)


# what usually causes a variant where nobody chose it, and the usual mend (said with a matched diagnosis)
_TF32_CAUSE = "an fp32 tl.dot computes in TF32 by default on NVIDIA GPUs; input_precision='ieee' keeps fp32"
CAUSES = {
    "tf32": _TF32_CAUSE,
    "tf32rz": _TF32_CAUSE,
    "dtacc": "an accumulator declared in the output dtype; accumulate in fp32 (tl.zeros(..., dtype=tl.float32))",
    "outacc": "Triton's combiner folds `prev + tl.dot(u, b)` into a dot accumulating from prev (in fp32 no cast "
              "stands between); keep the delta apart, e.g. `prev + tl.where(mask, d, 0.0)`",
}


def alternatives(backend_precision: str, dtype: torch.dtype) -> list[str]:
    """The preset names diagnose() tries for a backend declaring `backend_precision` at `dtype`.

    Each variant alone on the declared path (plus the plain path when the declaration has variants), where
    it changes something: TF32 operands (rounded or truncated) only for fp32 (fp16 and bf16 values are TF32
    values), bf16 operands not for bf16, the working-dtype accumulator not for fp32 (there it is the contract's),
    fp16 accumulation only for fp16 (the one MMA with an fp16 accumulator takes fp16 operands; bf16 and TF32 MMAs
    accumulate in fp32), the expand summed onto the output for fp32 and for paths that round the delta (a 16-bit
    path that keeps it unrounded differs from it by fp32 steps alone), path variants only where
    reference.precision.precision accepts them.
    A declared `exact` is tried against every path preset.
    """
    path, declared_variants = split_name(backend_precision)
    if path == "exact":
        return [p for p in PRESETS if p != "exact"]
    names = [path] if declared_variants else []
    for v in VARIANTS:
        if (v in declared_variants or (v in ("tf32", "tf32rz") and dtype != torch.float32)
                or (v == "bf16ops" and dtype == torch.bfloat16) or (v == "dtacc" and dtype == torch.float32)
                or (v == "fp16acc" and dtype != torch.float16)
                or (v == "outacc" and dtype != torch.float32 and not precision(path, dtype).round_delta)):
            continue
        name = compose(path, v)
        try:
            precision(name, dtype)
        except ValueError:
            continue
        names.append(name)
    return [n for n in names if n != backend_precision]


def _emulation(case: Case, name: str, device, inputs=None, mma=None) -> torch.Tensor:
    """The value of the rounding model `name` on the case's inputs (`inputs`, or rebuilt from its seed on
    `device`, where the truth is: a CUDA case's inputs are drawn there), its FP8 GEMMs on the verdict's e4m3 MMA
    (`mma`, Rules.mma)."""
    if case.level == "op":
        return op_reference(case, inputs if inputs is not None else build_op_inputs(case, device), name).value
    return expert_expectations(case, name, emulation_only=True, device=device, inputs=inputs, mma=mma)[2].value


def _fit(name, description, out, truth, emu, written, dtype, k_plus_r, rules: Rules = Rules()) -> ModelFit:
    # the verdict at the bound the model would be judged at if declared; the distance at the data's dtype
    under = dict(underflow=truth.underflow, work_dtype=dtype, **rules.kwargs(truth))
    v = compare_written(out, truth.value, emu, truth.scale, written, dtype=bound_dtype(name, dtype),
                        k_plus_r=k_plus_r, **under)
    swapped = compare_written(out, emu, truth.value, truth.scale, written, dtype=dtype, k_plus_r=k_plus_r, **under)
    return ModelFit(name, description, v.ratio, swapped.ratio, v.ok)


def worst_relative_error(output: torch.Tensor, truth, written: torch.Tensor) -> float:
    """max |out - truth| / scale over the written elements (inf where scale is 0 and they differ)."""
    o = output.detach().to(truth.value.device, torch.float64)[written]
    t, s = truth.value[written], truth.scale[written]
    err = (o - t).abs()
    rel = torch.where(s > 0, err / torch.where(s > 0, s, torch.ones_like(s)),
                      torch.where(err > 0, torch.full_like(err, math.inf), torch.zeros_like(err)))
    rel = torch.where(torch.isfinite(o) | ~torch.isfinite(t), rel, torch.full_like(rel, math.inf))
    return float(rel.max()) if rel.numel() else 0.0


def model_fits(case: Case, backend_precision: str, output: torch.Tensor, truth,
               rules: Rules = Rules()) -> list[ModelFit]:
    """Every model diagnose() tries (the declared one first, then `alternatives`), fitted to `output`, with no
    gating: a passing or grossly wrong output gets its fits too (e.g. to see which model a passing kernel
    follows most closely)."""
    dtype = torch_dtype(case)
    written, k_plus_r, _ = judging(case, truth)
    out = output.detach().to(truth.value.device)
    return [_fit(n, describe(n), out, truth, _emulation(case, n, out.device, mma=rules.mma), written, dtype,
                 k_plus_r, rules)
            for n in [backend_precision] + alternatives(backend_precision, dtype)]


def diagnose(case: Case, backend_precision: str, output: torch.Tensor, truth, *, inputs=None,
             emulation: torch.Tensor | None = None, rules: Rules = Rules()) -> Diagnosis | None:
    """Name the rounding model a failing output follows, or say that none does.

    `output`: the kernel's output as the runner judged it (op level (T, k, W), expert level (T, H));
    `truth`: the runner's float64 truth for the case (`Expectation.truth`: OpExpected / ExpertExpected);
    `inputs` and `emulation` (the declared model's value), where the runner has them, are not computed again;
    `rules`: the verdict's (expectation.Rules), so that the declared model fails here as it failed there.
    None when there is nothing to diagnose: the output passes against `backend_precision`, fails in a way
    that is no precision matter (non-finite, shape), or is grossly wrong (worst element > GROSS_REL scale).
    """
    if truth is None:
        return None
    written, k_plus_r, _ = judging(case, truth)
    out = output.detach().to(truth.value.device)

    def emulation_of(name):
        if name == backend_precision and emulation is not None:
            return emulation.to(out.device)
        return _emulation(case, name, out.device, inputs, rules.mma)
    return name_model(out, truth, written, torch_dtype(case), k_plus_r, backend_precision, emulation_of, rules)


def name_model(out: torch.Tensor, truth, written: torch.Tensor, dtype: torch.dtype, k_plus_r: int,
               backend_precision: str, emulation_of, rules: Rules = Rules()) -> Diagnosis | None:
    """diagnose() for any level: `emulation_of(name)` gives a rounding model's value on the inputs `out` came
    from (the layer level computes it from its scenario, the case levels from the case's seed). A gross error
    is told before any model is computed."""
    worst = worst_relative_error(out, truth, written)
    if worst > GROSS_REL:
        return None
    declared_emu = emulation_of(backend_precision)
    verdict = compare_written(out, truth.value, declared_emu, truth.scale, written,
                              dtype=bound_dtype(backend_precision, dtype), k_plus_r=k_plus_r,
                              underflow=truth.underflow, work_dtype=dtype, **rules.kwargs(truth))
    if verdict.ok or verdict.kind not in _DIAGNOSED_KINDS:
        return None
    declared = _fit(backend_precision, describe(backend_precision), out, truth, declared_emu, written, dtype,
                    k_plus_r, rules)
    fits = [declared] + [_fit(n, describe(n), out, truth, emulation_of(n), written, dtype, k_plus_r, rules)
                         for n in alternatives(backend_precision, dtype)]
    fits.sort(key=lambda f: f.distance)
    best = fits[0]
    matched = (best is not declared and best.passes and best.distance <= MATCH_DISTANCE
               and best.distance <= MARGIN * declared.distance)
    others = [f for f in fits if f is not declared]
    if matched:
        nxt = next((f for f in others if f is not best), None)
        text = (f"consistent with {best.description} ({best.name}): aggregate ratio {best.ratio:.3g} against its "
                f"emulation, {declared.ratio:.3g} against the declared {backend_precision}; the output is "
                f"{best.distance:.2g}x that model's error from its emulation"
                + (f" (next nearest: {nxt.description}, {nxt.distance:.2g}x)" if nxt else "")
                + f"; if the kernel rounds so on purpose, declare precision {best.name!r}"
                + "".join(f"; if not, a usual cause: {CAUSES[v]}" for v in split_name(best.name)[1] if v in CAUSES))
        shown = best
    else:
        shown = others[0] if others else declared
        text = (f"no rounding model explains it (worst element off by {worst:.2g} of its scale): nearest "
                + (f"{shown.description} ({shown.name}), {shown.distance:.2g}x its error from its emulation, "
                   f"aggregate ratio {shown.ratio:.3g}; " if others else "")
                + f"declared {backend_precision}: {declared.distance:.2g}x, ratio {declared.ratio:.3g} "
                f"(bound {RATIO:g})")
    return Diagnosis(model=shown.name if matched else None, description=shown.description, ratio=shown.ratio,
                     distance=shown.distance, declared=backend_precision, declared_ratio=declared.ratio,
                     declared_distance=declared.distance, worst_rel=worst, text=text, fits=fits)
