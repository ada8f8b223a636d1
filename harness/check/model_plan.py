"""Model mode of `check`: every feature of the check matrix at one served layer's shape (harness.served.models), over a
list of token counts from decode to prefill, in the dtypes of the device's profile.

Whether a feature applies is read from the fields it sets: one that sets a field the layer fixes (H, I, E, top_k,
activation, biases, the w13 slice count, the TP / EP slice) to another value is about another layer and gets a
row saying so; a feature whose only point is a token count is one too (the token counts are --tokens'). A case
too large for this machine is reported not runnable with the bytes it needs (harness.build.case_memory), not run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.build.case_memory import free_bytes, gib, memory_need
from moe_lora_harness.harness.check.features import DECODE_MOST_TOKENS, DECODE_ROWS
from moe_lora_harness.harness.served.models import MoELayer, case_fields
from moe_lora_harness.harness.draw.profiles import Shapes, shapes_for

# Decode to prefill: one token (a single decode step); 7 (an odd batch: a partial tile everywhere); 64 (a full
# decode batch, a CUDA-graph capture size); 4096 + 17 (a prefill chunk just past a block edge: 17 rows past a
# 16- or 128-row block); 16384 (a long prefill chunk, vLLM's larger max_num_batched_tokens settings).
DEFAULT_TOKENS = (1, 7, 64, 4096 + 17, 16384)
NOT_APPLICABLE = " (n/a)"   # the suffix of a feature row that does not apply at the layer's shape


@dataclass
class ModelPlan:
    """What model mode runs: `runs` (backend, spec, feature, case), rows that need no run (`prejudged`: cases too
    large for this machine), the features that do not apply with why, and cases dropped with why."""

    layer: MoELayer
    device: str
    tp: int
    ep: int
    tokens: tuple
    rows: list = field(default_factory=list)            # the matrix's row names, in order
    runs: list = field(default_factory=list)
    prejudged: list = field(default_factory=list)       # (row, Outcome)
    not_applicable: dict = field(default_factory=dict)  # feature -> reason
    dropped: list = field(default_factory=list)         # (feature, case JSON, reason)

    def notes(self) -> list[str]:
        """Lines printed under the matrix: what did not apply, and what was left out, with why."""
        lines = []
        if self.not_applicable:
            lines.append(f"\nnot applicable at {self.layer.name}'s layer ({shape_text(self.layer, self.tp, self.ep)}):")
            lines += [f"  {f}: {why}" for f, why in self.not_applicable.items()]
        if self.dropped:
            lines.append("\ncases left out (malformed at this shape):")
            lines += [f"  {f}: {why}: {case}" for f, case, why in self.dropped]
        return lines

    def meta(self) -> dict:
        return {"model": self.layer.name, "tp": self.tp, "ep": self.ep, "tokens": list(self.tokens),
                "layer": shape_text(self.layer, self.tp, self.ep), "not_applicable": self.not_applicable,
                "dropped": [{"feature": f, "case": c, "reason": r} for f, c, r in self.dropped]}


def shape_text(layer: MoELayer, tp: int = 1, ep: int = 1) -> str:
    """The shape one rank runs, e.g. 'H=2048 I=384 (768/2) E=128 (32 on EP rank 3 of 4) top_k=8 silu'."""
    f = case_fields(layer, tp, ep)
    text = f"H={f['H']} I={f['I']}" + (f" ({layer.I}/{tp})" if tp > 1 else "") + f" E={f['E']}"
    if ep > 1:
        text += f" ({f['E'] // ep} on EP rank {ep - 1} of {ep})"
    return text + f" top_k={f['top_k']} {f['activation']}" + (" with biases" if f["bias"] else "")


def layer_shapes(layer: MoELayer, device: str, tp: int = 1, ep: int = 1, T: int = 1) -> Shapes:
    """The device profile's Shapes with the layer's sizes: what a feature's `make` is evaluated at."""
    f = case_fields(layer, tp, ep)
    return dataclasses.replace(shapes_for(device), T=T, H=f["H"], I=f["I"], E=f["E"], top_k=f["top_k"])


def fixed_fields(layer: MoELayer, tp: int, ep: int, which: str = "w13", adapters: dict | None = None) -> dict:
    """The Case fields the layer fixes: case_fields, plus the w13 slice count of its form (op level, w13 only),
    plus, with adapter files (`adapters`: adapter_fields), the slots and ranks they fill."""
    fixed = dict(case_fields(layer, tp, ep), **(adapters or {}))
    if which == "w13":
        fixed["num_slices"] = 2 if layer.gated else 1
    return fixed


MIN_SLOTS = 3   # with adapter files, at least this many slots: the ones past the files stay empty


def adapter_fields(layer: MoELayer, paths, adapter_layer: int = 0) -> dict:
    """The Case fields of PEFT adapter folders `paths` for `layer` (read once here: a file that does not fit the
    layer raises naming it): slots 0.. hold them at their own ranks, max_rank the largest."""
    from moe_lora_harness.harness.served.peft_adapters import read_adapter
    f = case_fields(layer)
    ranks = tuple(read_adapter(p, num_experts=f["E"], hidden_size=f["H"], intermediate_size=f["I"],
                               gated=layer.gated, layer=adapter_layer,
                               interleaved=f["activation"] == "swigluoai").rank for p in paths)
    L = max(MIN_SLOTS, len(paths))
    return dict(adapters=tuple(str(p) for p in paths), adapter_layer=adapter_layer, max_loras=L,
                ranks=ranks + (0,) * (L - len(ranks)), max_rank=max(ranks), shared_a=False, shared_b=False)


def applicability(feature, layer: MoELayer, shapes: Shapes, tp: int = 1, ep: int = 1, adapters=None) -> str:
    """'' when `feature` applies at the layer's shape (and adapter files), else why not (the fields it would
    change, or its only point being a token count)."""
    made = feature.make(shapes)
    fixed = fixed_fields(layer, tp, ep, made.get("which", "w13"), adapters if feature.level == "expert" else None)
    clashes = [f"{k}={made[k]!r} (the layer's: {fixed[k]!r})" for k in made if k in fixed and made[k] != fixed[k]]
    if clashes:
        return "sets " + ", ".join(clashes)
    own = set(made) | set(feature.per_case(shapes, 0) if feature.per_case else {})
    if own - {"dtype"} == {"T"}:
        return "its only point is a token count; model mode's token counts are --tokens'"
    return ""


def _budget(device: str, budget) -> tuple[int, str]:
    return (int(budget), "the given budget") if budget is not None else free_bytes(device)


def plan_model(layer: MoELayer, specs: dict, device: str, features, *, tp: int = 1, ep: int = 1,
               tokens=DEFAULT_TOKENS, budget: int | None = None, adapters: dict | None = None) -> ModelPlan:
    """Every feature of `features` at `layer`'s shape for every backend of `specs` (at the levels it has), at each
    token count and in each dtype of the device's profile (or the one the feature sets). `budget` overrides the
    free memory a case must fit in (bytes); `adapters` (adapter_fields) puts adapter files in the expert-level
    cases' slots."""
    tokens = tuple(tokens)
    plan = ModelPlan(layer, device, tp, ep, tokens)
    shapes = layer_shapes(layer, device, tp, ep, T=tokens[0])
    free, where = _budget(device, budget)
    for feat in features:
        ad = adapters if feat.level == "expert" else None
        why = applicability(feat, layer, shapes, tp, ep, ad)
        if why:
            plan.not_applicable[feat.name] = why
            plan.rows.append(feat.name + NOT_APPLICABLE)
            continue
        made = feat.make(shapes)
        base = dict(feat.case_fields(shapes, 0), **fixed_fields(layer, tp, ep, made.get("which", "w13"), ad))
        dtypes = (made["dtype"],) if "dtype" in made else shapes.dtypes
        cases = []
        decode_row = bool(base.get("call_tokens"))    # the decode row: its prefill counts are dropped
        for j, (T, dt) in enumerate((T, dt) for T in tokens for dt in dtypes):
            fields = dict(base, T=T, dtype=dt, seed=base["seed"] + j)
            if decode_row and not 0 < T <= DECODE_MOST_TOKENS:
                plan.dropped.append((feat.name, Case(**fields).to_json(),
                                     f"decode calls hold 1 to {DECODE_MOST_TOKENS} tokens"))
                continue
            if feat.pooled_decode and 0 < T <= DECODE_MOST_TOKENS:
                fields.update(T=T * max(2, -(-DECODE_ROWS // T)), call_tokens=T)
            case = Case(**fields)
            problems = case.problems()
            if problems:
                plan.dropped.append((feat.name, case.to_json(), "; ".join(problems)))
            else:
                cases.append(case)
        if not cases:
            plan.not_applicable[feat.name] = f"no well-formed case at this shape ({plan.dropped[-1][2]})"
            plan.rows.append(feat.name + NOT_APPLICABLE)
            continue
        plan.rows.append(feat.name)
        for name, spec in specs.items():
            if feat.level not in spec.capabilities.levels:
                continue
            for case in cases:
                need = memory_need(case, device)
                if need.total > free:
                    plan.prejudged.append((feat.name, _too_large(spec, case, device, need, free, where)))
                else:
                    plan.runs.append((name, spec, feat.name, case))
    return plan


def _too_large(spec, case: Case, device: str, need, free: int, where: str):
    """The Outcome of a case this machine cannot hold: declined if the backend declines it, else not runnable."""
    from moe_lora_harness.harness.spec.contract import support_for
    from moe_lora_harness.harness.execution.runner import Outcome
    try:
        ok, reason = support_for(spec, case, device)
    except Exception:  # noqa: BLE001 - its declaration's error surfaces when the case is run on a larger machine
        ok, reason = True, ""
    if not ok:
        return Outcome(spec.name, case, device, "unsupported", reason)
    return Outcome(spec.name, case, device, "not-runnable",
                   f"not runnable on this machine: T={case.T} {case.dtype} {need.describe()}; {gib(free)} {where}")
