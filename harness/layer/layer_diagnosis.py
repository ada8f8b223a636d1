"""What a failing layer step's rows follow: which slots they map to, the rounding model (the case levels' precision
diagnosis, on the scenario's own inputs) and the serving mistake (no adapter applied, another slot's adapter, the
scaling applied twice, the previous batch's mapping, the previous output accumulated into a replay).

Advice for the failure text only: the verdict is the judge's (harness.layer.layer_judge); docs/architecture.md, "The layer
level".
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from moe_lora_harness.harness.judge.compare import RATIO, other_points_rows, row_ratios
from moe_lora_harness.harness.judge.expectation import Rules
from moe_lora_harness.reference.precision import bound_dtype

ROWS_SHOWN = 8


@dataclasses.dataclass
class StepContext:
    """One judged step: its rows, the real ones' count, each row's judged slot, the expected (truth, emulation)
    for a mapping and adapters (`expected(mapping, adapters=None, precision=None)`), and the step before it."""

    rows: torch.Tensor
    real: int
    effective: torch.Tensor            # (S,) int32, -1: no adapter
    adapters: list                     # ExpertAdapter per slot (None: empty), what the layer should hold
    expected: Callable
    precision: str
    judge: Callable                    # (rows, truth, emulation, precision) -> Verdict
    k_plus_r: int = 1                  # the bounds' K + R (H + I + max_rank)
    previous: tuple | None = None      # (its mapping list, its rows) of the run before this one, if any
    rules: Rules = Rules()             # the verdict's (groups: the judged slots; the twin's: none)


def slots_of_rows(ctx: StepContext, truth, emu, dtype) -> str:
    """The rows that fail rule 3 alone or hold the worst elements, each with the slot it maps to."""
    written = torch.zeros(ctx.rows.shape, dtype=torch.bool)
    written[:ctx.real] = True
    bdt = bound_dtype(ctx.precision, dtype)
    other_rows = other_points_rows(emu.value, getattr(truth, "round_var", None), written, bdt, ctx.rules.points_only)
    ratios = row_ratios(ctx.rows.to(torch.float64), truth.value, emu.value, truth.scale, written, None,
                        dtype=bdt, k_plus_r=ctx.k_plus_r, underflow=truth.underflow, work_dtype=dtype,
                        acc_var=truth.acc_var, other_rows=other_rows)   # as the verdict's rule 3 (layer_judge._compare)
    over = [int(t) for t in (ratios > RATIO).nonzero()[:, 0]]
    shown = over or [int(t) for t in ratios.argsort(descending=True)[:ROWS_SHOWN]]
    by_slot: dict = {}
    for t in over or shown:
        by_slot.setdefault(int(ctx.effective[t]), []).append(t)
    parts = [f"slot {s}: rows {ts[:ROWS_SHOWN]}" + (f" (+{len(ts) - ROWS_SHOWN})" if len(ts) > ROWS_SHOWN else "")
             if s >= 0 else f"no adapter: rows {ts[:ROWS_SHOWN]}" for s, ts in sorted(by_slot.items())]
    head = (f"{len(over)} of {ctx.real} rows fail rule 3 alone" if over
            else f"no row fails alone; the rows farthest from the truth")
    return f"{head}: " + "; ".join(parts)


def _other_slot(ctx: StepContext):
    loaded = [s for s, a in enumerate(ctx.adapters) if a is not None]
    if len(loaded) < 2 or not bool((ctx.effective[:ctx.real] >= 0).any()):
        return None
    nxt = {s: loaded[(loaded.index(s) + 1) % len(loaded)] for s in loaded}
    m = torch.tensor([nxt.get(int(s), -1) for s in ctx.effective], dtype=torch.int32)
    return ctx.expected(m)


def _no_adapter(ctx: StepContext):
    if not bool((ctx.effective[:ctx.real] >= 0).any()):
        return None
    return ctx.expected(torch.full_like(ctx.effective, -1))


def _scaling_twice(ctx: StepContext):
    if not bool((ctx.effective[:ctx.real] >= 0).any()):
        return None
    twice = [None if a is None else dataclasses.replace(
        a, scaling=a.scaling ** 2, down_scaling=(a.scaling if a.down_scaling is None else a.down_scaling) ** 2)
        for a in ctx.adapters]
    return ctx.expected(ctx.effective, adapters=twice)


def _previous_mapping(ctx: StepContext):
    if ctx.previous is None:
        return None
    prev = list(ctx.previous[0])[:ctx.real]
    m = ctx.effective.clone()
    for t, s in enumerate(prev):
        m[t] = s if s >= 0 and ctx.adapters[s] is not None else -1
    if bool((m == ctx.effective).all()):
        return None
    return ctx.expected(m)


def _previous_output_added(ctx: StepContext):
    if ctx.previous is None or tuple(ctx.previous[1].shape) != tuple(ctx.rows.shape):
        return None
    truth, emu = ctx.expected(ctx.effective)
    prev = ctx.previous[1].to(torch.float64)
    return (dataclasses.replace(truth, value=truth.value + prev, scale=truth.scale + prev.abs()),
            dataclasses.replace(emu, value=emu.value + prev))


# name -> (what it says, the (truth, emulation) the rows would have under it, None where it changes nothing here)
MISTAKES = {
    "no-adapter": ("no adapter applied to the rows that have one", _no_adapter),
    "other-slot": ("each row given another loaded slot's adapter", _other_slot),
    "scaling-twice": ("the adapters' scaling applied twice", _scaling_twice),
    "previous-mapping": ("the previous batch's mapping used (a stale token -> slot map)", _previous_mapping),
    "previous-output": ("the previous output accumulated into this one", _previous_output_added),
}


def semantic_fits(ctx: StepContext) -> list:
    """The serving mistakes the failing rows follow (the judge passes them against it), as phrases."""
    fits = []
    for name, (words, alt) in MISTAKES.items():
        got = alt(ctx)
        if got is None:
            continue
        v = ctx.judge(ctx.rows, got[0], got[1], ctx.precision, ctx.rules.groups)
        if v.ok:
            fits.append(f"{words} ({name}: aggregate ratio {v.ratio:.3g})")
    return fits


def precision_line(ctx: StepContext, truth, dtype) -> str | None:
    """The rounding model the rows follow, named as the case levels name it (None: nothing to say)."""
    from moe_lora_harness.harness.judge.diagnose import name_model
    written = torch.zeros(ctx.rows.shape, dtype=torch.bool)
    written[:ctx.real] = True
    d = name_model(ctx.rows, truth, written, dtype, ctx.k_plus_r, ctx.precision, lambda n: ctx.expected(
        ctx.effective, precision=n)[1].value, ctx.rules)
    return None if d is None else "precision: " + d.text


def explain(ctx: StepContext, truth, emu, dtype, kind: str) -> list:
    """The diagnosis lines of a value failure: its rows and their slots; the serving mistake it follows, else the
    rounding model (the mistakes first: a layer's failures are mostly state, and the rounding models' emulations
    cost more)."""
    lines = []
    try:
        lines.append("rows: " + slots_of_rows(ctx, truth, emu, dtype))
        fits = semantic_fits(ctx)
        if fits:
            return lines + ["semantics: consistent with " + "; or ".join(fits)]
        p = precision_line(ctx, truth, dtype) if kind in ("element", "aggregate") else None
        lines.append(p or "precision: the error is too large for any rounding model")
        if p is None or "consistent with" not in p:
            lines.append("semantics: no serving mistake of the table fits (" + ", ".join(MISTAKES) + ")")
    except Exception as e:  # noqa: BLE001 - advice; its failure must not hide the verdict
        lines.append(f"(no diagnosis: {type(e).__name__}: {e})")
    return lines
