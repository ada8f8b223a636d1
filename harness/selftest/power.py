"""The judge's power: the smallest planted slip it fails, per slip class and shape, as a multiple of a correct
kernel's own distance from the truth, beside `torch.testing.assert_close(atol=rtol=2e-2)` (vLLM's MoE test oracle)
on the same outputs.

A slip is a realistic kernel mistake of adjustable size `alpha` in (0, 1] (alpha 0: the correct computation), made
by rewriting the inputs a correct expert backend is handed (partial K or N tiles dropped, a rank component lost,
a scaling or one slice mis-scaled, one token, slot or expert wrong): SLIPS is the only table a new class needs. For
each slip the judge's threshold is found by bisection on alpha (the judge's truth and emulation computed once), and
so is the oracle's; every output evaluated is judged by both, and an output the oracle fails that the judge passes
is counted (`oracle_only`: it must stay 0). Where the judge runs a twin (expectation.twin_applies: fp32, or FP8
summed exactly for a backend declared to round at its model's points; 83 rows or more, or fp32 rows of 512 elements)
the slipped kernel runs on the reordered inputs too, and the pair is judged as the runner judges it. Beside them, a
precision mistake that has no size to bisect: every GEMM's accumulator kept in the working dtype between K tiles
(ACCUMULATOR_TILES), its output judged and put to the oracle. An op-level case (one `fused_moe_lora` call) has its
own table of the same mistakes, OP_SLIPS. docs/error-model.md, "Power".
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moe_lora_harness.harness.build.builders import ExpertInputs, OpInputs
from moe_lora_harness.harness.spec.case import FP8_QUANTS, Case
from moe_lora_harness.harness.judge.compare import EXCESS_MIN_ROWS, RULE4_OFF
from moe_lora_harness.harness.build.properties import twin_columns, view_inputs
from moe_lora_harness.harness.judge.expectation import (Rules, declared_rounding, emulate_twin, judge_twins, row_groups,
                                                        twin_applies, twin_truth)
from moe_lora_harness.reference.precision import precision as make_precision

ORACLE_TOL = 2e-2      # vLLM tests/kernels/moe/test_moe.py: assert_close(atol=2e-2, rtol=2e-2)
ORACLE_DRAWS = 4       # other seeds of a case's shape the oracle must pass the correct kernel on, before what only it
                       # fails counts against the judge


def _tail(n: int, alpha: float) -> slice:
    """The last ceil(alpha n) of n indices (at least one): a partial tile dropped at the end of a loop."""
    m = max(1, min(n, math.ceil(alpha * n)))
    return slice(n - m, n)


def _scaled(t: torch.Tensor, index, factor: float) -> torch.Tensor:
    """A copy of `t` with `t[index]` multiplied by `factor` (in float64, rounded once)."""
    t = t.clone()
    t[index] = (t[index].to(torch.float64) * factor).to(t.dtype)
    return t


def _tail_zeroed(t: torch.Tensor, dim: int, alpha: float) -> torch.Tensor:
    """A copy of `t` with the last ceil(alpha n) of its n indices along `dim` zeroed (`_tail`)."""
    t = t.clone()
    idx = [slice(None)] * t.dim()
    idx[dim] = _tail(t.shape[dim], alpha)
    t[tuple(idx)] = 0
    return t


def _row_mixed(t: torch.Tensor, alpha: float) -> torch.Tensor:
    """A copy of `t` whose row 0 reads alpha of row 1 (a row offset)."""
    t = t.clone()
    if t.shape[0] > 1:
        t[0] = ((1 - alpha) * t[0].to(torch.float64) + alpha * t[1].to(torch.float64)).to(t.dtype)
    return t


def _lists(inp, name: str, fn, last_only: bool = False):
    """`inp` with `fn` applied to every tensor (or the last: `last_only`) of its LoRA list `name`: an expert-level
    case's stacked factors (w13_a, w13_b, w2_a, w2_b), or an op-level call's (lora_a, lora_b)."""
    holder = getattr(inp, "stacked", inp)
    lst = list(getattr(holder, name))
    lst = lst[:-1] + [fn(lst[-1])] if last_only else [fn(t) for t in lst]
    if holder is inp:
        return dataclasses.replace(inp, **{name: lst})
    return dataclasses.replace(inp, stacked=dataclasses.replace(holder, **{name: lst}))


def _base_tail(inp, name, alpha):
    w = getattr(inp, name).clone()
    w[..., _tail(w.shape[-1], alpha)] = 0
    return dataclasses.replace(inp, **{name: w})


def _first_pair_weight(inp, alpha):
    w = inp.topk_weights.clone()
    w[:, 0] = w[:, 0] * (1 + alpha)
    return dataclasses.replace(inp, topk_weights=w)


@dataclass(frozen=True)
class Slip:
    """One class of kernel mistake: `make(inputs, alpha)` -> the inputs a correct backend computing it is handed."""

    name: str
    description: str
    make: Callable[[ExpertInputs | OpInputs, float], ExpertInputs | OpInputs]
    lora: bool = True          # needs the case's LoRA


SLIPS = (
    Slip("w13-shrink-k-tail", "the w13 LoRA shrink drops its last K tiles (alpha of H)",
         lambda i, a: _lists(i, "w13_a", lambda t: _tail_zeroed(t, 3, a))),
    Slip("w2-shrink-k-tail", "the w2 LoRA shrink drops its last K tiles (alpha of I)",
         lambda i, a: _lists(i, "w2_a", lambda t: _tail_zeroed(t, 3, a))),
    Slip("w2-expand-n-tail", "the w2 LoRA expand drops its last N tiles (alpha of H)",
         lambda i, a: _lists(i, "w2_b", lambda t: _tail_zeroed(t, 2, a))),
    Slip("w13-expand-n-tail", "the w13 LoRA expand drops its last N tiles (alpha of I, every slice)",
         lambda i, a: _lists(i, "w13_b", lambda t: _tail_zeroed(t, 2, a))),
    Slip("base-gemm1-k-tail", "the base w13 GEMM drops its last K tiles (alpha of H)",
         lambda i, a: _base_tail(i, "w13", a), lora=False),
    Slip("base-gemm2-k-tail", "the base w2 GEMM drops its last K tiles (alpha of I)",
         lambda i, a: _base_tail(i, "w2", a), lora=False),
    Slip("rank-component", "the last rank component of every LoRA A reduced by alpha (lost at 1)",
         lambda i, a: _lists(_lists(i, "w13_a", lambda t: _scaled(t, (..., -1, slice(None)), 1 - a)),
                             "w2_a", lambda t: _scaled(t, (..., -1, slice(None)), 1 - a))),
    Slip("scaling", "every LoRA B scaled by 1 - alpha (r/(r+1): alpha = 1/(r+1))",
         lambda i, a: _lists(_lists(i, "w13_b", lambda t: _scaled(t, (...,), 1 - a)),
                             "w2_b", lambda t: _scaled(t, (...,), 1 - a))),
    Slip("slice-scale", "the w13 delta's last slice (up, when gated) scaled by 1 + alpha",
         lambda i, a: _lists(i, "w13_b", lambda t: _scaled(t, (...,), 1 + a), last_only=True)),
    Slip("one-slot-w2", "slot 0's w2 LoRA delta reduced by alpha (missing at 1)",
         lambda i, a: _lists(i, "w2_b", lambda t: _scaled(t, (0,), 1 - a))),
    Slip("one-expert-w13", "expert 0's w13 LoRA delta reduced by alpha (missing at 1)",
         lambda i, a: _lists(i, "w13_b", lambda t: _scaled(t, (slice(None), 0), 1 - a))),
    Slip("one-token", "token 0 reads alpha of token 1's hidden state (a row offset)",
         lambda i, a: dataclasses.replace(i, hidden=_row_mixed(i.hidden, a)), lora=False),
    Slip("router-weight", "every token's first routing weight read 1 + alpha times too large",
         _first_pair_weight, lora=False),
)


# the same classes of mistake in one fused_moe_lora call (an op-level case; harness.build.builders.OpInputs): the only
# table a new op-level class needs
OP_SLIPS = (
    Slip("shrink-k-tail", "the shrink drops its last K tiles (alpha of K, every slice)",
         lambda i, a: _lists(i, "lora_a", lambda t: _tail_zeroed(t, 3, a))),
    Slip("expand-n-tail", "the expand drops its last N tiles (alpha of N, every slice)",
         lambda i, a: _lists(i, "lora_b", lambda t: _tail_zeroed(t, 2, a))),
    Slip("rank-component", "the last rank component of every A reduced by alpha (lost at 1)",
         lambda i, a: _lists(i, "lora_a", lambda t: _scaled(t, (..., -1, slice(None)), 1 - a))),
    Slip("scaling", "every B scaled by 1 - alpha (r/(r+1): alpha = 1/(r+1))",
         lambda i, a: _lists(i, "lora_b", lambda t: _scaled(t, (...,), 1 - a))),
    Slip("slice-scale", "the last slice's delta scaled by 1 + alpha",
         lambda i, a: _lists(i, "lora_b", lambda t: _scaled(t, (...,), 1 + a), last_only=True)),
    Slip("one-slot", "slot 0's delta reduced by alpha (missing at 1)",
         lambda i, a: _lists(i, "lora_b", lambda t: _scaled(t, (0,), 1 - a))),
    Slip("one-expert", "expert 0's delta reduced by alpha (missing at 1)",
         lambda i, a: _lists(i, "lora_b", lambda t: _scaled(t, (slice(None), 0), 1 - a))),
    Slip("one-row", "x's row 0 reads alpha of row 1 (a row offset)",
         lambda i, a: dataclasses.replace(i, x=_row_mixed(i.x, a))),
    Slip("router-weight", "every token's first routing weight read 1 + alpha times too large (where the call "
                          "multiplies by it: mul_routed_weight)", _first_pair_weight),
)


# the geometric bisection's steps per slip (measure): each halves the bracket's log-ratio
BISECTION_STEPS = 14
STEP_GAP = 1.05        # Threshold.steps: how much more than its alpha a slip's size may grow across the threshold


def bisect_geometric(fails, lo: float, hi: float, steps: int = BISECTION_STEPS) -> float:
    """The smallest size `fails(size)` is true at, between `lo` (passes) and `hi` (fails): `hi` after `steps`
    geometric halvings, above the threshold by at most a factor (hi / lo) ** 2 ** -steps."""
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fails(mid) else (mid, hi)
    return hi

# the precision mistake: every GEMM's accumulator kept in the working dtype between K tiles (the reference's dtacc
# variant, Precision.acc_tile) at the BLOCK_K values vLLM's fused_moe configurations use
ACCUMULATOR_TILES = (64, 128, 256)


@dataclass
class PrecisionSlip:
    """A precision mistake's output (the declared model's emulation with the mistake) judged by the backend's rules:
    its distance from the emulation in multiples of the emulation's own error, and each oracle's verdict."""

    slip: str
    multiple: float
    judge_fails: bool
    oracle_fails: bool


@dataclass
class Threshold:
    """Where one rule set first fails a slip: alpha, and the slip's size ||out - out_0|| as a multiple of the
    correct output's own distance from the truth (None: not failed at alpha = 1); `smallest`: failed already at the
    slip's smallest size (one dropped column of a tail slip), so the threshold is at most that."""

    alpha: float | None
    multiple: float | None
    smallest: bool = False
    no_effect: bool = False   # the slip changes nothing on this case (e.g. expert 0 received no token)
    passed: float | None = None   # the size at the largest alpha tried below `alpha` that passed: the threshold lies
    passed_alpha: float | None = None   # between the two; a bisection step apart for a slip that grows with alpha

    @property
    def steps(self) -> bool:
        """The slip's size jumps across the threshold: between the alphas that pass and fail it grows more than
        STEP_GAP times what they do (a tail slip drops whole columns), so `passed` says where the threshold lies."""
        return (self.passed is not None and self.multiple is not None and self.passed > 0
                and self.multiple / self.passed > STEP_GAP * self.alpha / self.passed_alpha)


@dataclass
class SlipPower:
    slip: str
    judge: Threshold
    oracle: Threshold
    oracle_only: int          # outputs the oracle failed and the judge passed (must be 0)
    evaluated: int
    oracle_only_rows: int = 0  # the most token rows any of those outputs changed (below EXCESS_MIN_ROWS: a mistake
                               # confined to fewer rows than rule 4 needs, the judge's declared limit)


@dataclass
class PowerReport:
    case: Case
    backend: str
    kernel_rel_error: float   # ||out_0 - truth|| / ||truth||
    kernel_ratio: float       # the judge's statistic on the correct output
    kernel_ok: bool
    oracle_use: float         # the correct output's worst element as a fraction of the oracle's tolerance there
    slips: list
    seconds: float
    precision_slips: list = dataclasses.field(default_factory=list)   # PrecisionSlip per accumulator tile
    rule4_off: bool | None = None    # rule 4 judged none of the rows (compare.RULE4_OFF); None: as its quant says
    other_draws: tuple = ()   # oracle_use of the correct kernel on other seeds of the shape, where some output only the
                              # oracle fails asked for them (`oracle_other_draws`; it stops at the first failure)

    @property
    def oracle_ok(self) -> bool:
        """The oracle passes the correct output, and the correct kernel's outputs on the shape's other draws."""
        return all(oracle_passes(u) for u in (self.oracle_use, *self.other_draws))


def oracle_use(out: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest |out - truth| / (atol + rtol |truth|) of assert_close(atol=rtol=ORACLE_TOL) (truth rounded to
    out's dtype, as the oracle compares): over 1 it fails. Beside a correct output it says how much room the oracle
    leaves a correct kernel, which is what a slip it fails first may be using."""
    o, t = out.to(torch.float64), truth.to(out.dtype).to(torch.float64)
    if not torch.isfinite(o).all():
        return math.inf
    return float(((o - t).abs() / (ORACLE_TOL + ORACLE_TOL * t.abs())).max())


def oracle_passes(use: float) -> bool:
    """The oracle's verdict from `oracle_use`'s fraction."""
    return use <= 1.0


def _oracle_fails(out: torch.Tensor, truth: torch.Tensor) -> bool:
    return not oracle_passes(oracle_use(out, truth))


def oracle_other_draws(spec, case: Case, device: str = "cpu", draws: int = ORACLE_DRAWS) -> tuple:
    """oracle_use of `spec`'s output on `draws` other seeds of `case` (the same shape, dtype, slots and calls): an
    oracle that fails a correct kernel on one of them fails correct kernels at this shape, so an output only it fails
    on the measured draw is no evidence against the judge (FP8 rows in fp16: the correct kernel's worst element
    lands on either side of the tolerance from draw to draw)."""
    from moe_lora_harness.harness.build.builders import build_device, build_expert_inputs, build_op_inputs
    from moe_lora_harness.harness.build.expert_runner import expert_forward
    from moe_lora_harness.harness.judge.expectation import op_reference
    uses = []
    for i in range(1, draws + 1):
        c = case.replace(seed=case.seed + i)
        if c.level == "op":
            inp = build_op_inputs(c, build_device(device))
            truth = op_reference(c, inp).value
        else:
            inp = build_expert_inputs(c, device)
            forward, args, kw = expert_forward(c, inp)
            truth = forward(*args, precision=make_precision("exact", None), **kw).value
        uses.append(oracle_use(runner(spec, c, device)(inp).to(truth.device), truth))
        if not oracle_passes(uses[-1]):
            break                 # one false verdict is enough to set the oracle aside
    return tuple(uses)


@dataclass(frozen=True)
class CorrectRun:
    """A backend's output on one case (expert or op level) beside what the judge holds it to: the case's inputs, the
    float64 truth, the emulation of the backend's declared rounding model (`precision`), and whether it declares it
    rounds only at that model's points."""

    precision: str
    points_only: bool
    inputs: ExpertInputs | OpInputs
    truth: object             # reference.experts.ExpertExpected (an op-level case: its OpExpected)
    emulation: object         # its emulation (`.value`)
    out: torch.Tensor         # the backend's output, in its dtype and on its device
    twin_inputs: ExpertInputs | OpInputs | None = None   # the reordered view's inputs, where the judge runs a twin
    twin: torch.Tensor | None = None            # the backend's output on them, in the plain columns
    mma: int | str | None = None                # the e4m3 MMA the emulation runs (expectation.modelled_mma)
    twin_emulation: torch.Tensor | None = None  # the twin's own emulation, in the plain columns, where it has one
    twin_truth: object = None                   # the twin's own truth, where it has one (expectation.twin_own_truth)


def runner(spec, case: Case, device: str) -> Callable:
    """inputs -> `spec`'s output on them, run in this process on `device`: an expert-level case's calls as a run
    makes them (execute.run_expert_inputs: one rank's, every TP rank's or every simulated dispatched-EP rank's), or one
    `fused_moe_lora` call on a copy of the op's output buffer."""
    if case.level != "op":
        from moe_lora_harness.harness.execution.execute import run_expert_inputs
        return lambda i: run_expert_inputs(spec, i, case, device)

    def run_op(i):
        if i.x.device.type != torch.device(device).type:
            i = i.to(device)
        kw = i.call_kwargs()
        kw["output"] = i.output.clone()
        spec.op(**kw)
        return kw["output"]
    return run_op


def correct_run(spec, case: Case, device: str = "cpu") -> CorrectRun:
    """`spec`'s output on `case` (expert or op level; run in this process) with its truth and declared model's
    emulation: what `measure` starts from, and the studies under bench/ read."""
    from moe_lora_harness.harness.build.expert_runner import expert_expectations
    from moe_lora_harness.harness.judge.expectation import op_expectations
    precision, points_only, mma = declared_rounding(spec, case, device)
    if case.level == "op":
        inp, truth, emu = op_expectations(case, precision, device)
    else:
        inp, truth, emu = expert_expectations(case, precision, device=device, mma=mma)
    run = runner(spec, case, device)
    out = run(inp)
    if not twin_applies(case, device, mma, points_only):
        return CorrectRun(precision, points_only, inp, truth, emu, out, mma=mma)
    twin_inp = view_inputs(inp, "reordered")
    return CorrectRun(precision, points_only, inp, truth, emu, out, twin_inp,
                      twin_columns(run(twin_inp), case), mma,
                      emulate_twin(case, precision, twin_inp, device, mma), twin_truth(case, twin_inp))


def measure(spec, case: Case, device: str = "cpu", slips=None, steps: int = BISECTION_STEPS,
            progress=None, oracle_draws: int = ORACLE_DRAWS) -> PowerReport:
    """Thresholds of the judge and the oracle for each slip (default: SLIPS, OP_SLIPS for an op-level case) on one
    case, `spec` (a backend that claims it) computing the slipped inputs in this process; and, at the expert level,
    the working-dtype accumulator's outputs (the declared model's emulation with that mistake) judged. The oracle
    stands beside the judge only where it passes the correct kernel on the case; where some output only it fails,
    on `oracle_draws` other seeds of the shape too (`oracle_other_draws`)."""
    t0 = time.time()
    if slips is None:
        slips = OP_SLIPS if case.level == "op" else SLIPS
    c = correct_run(spec, case, device)
    precision, inp, truth, emu, out0 = c.precision, c.inputs, c.truth, c.emulation, c.out
    rules = Rules(device, c.points_only, row_groups(inp, truth), mma=c.mma)     # the runner's (Expectation.rules)
    run = runner(spec, case, device)

    def judge(out, twin=None):     # the runner's verdict (with the twin run, where it runs one)
        return judge_twins(case, out, twin, truth, emu.value, precision, rules, c.twin_emulation, c.twin_truth)

    def slipped(slip, alpha):      # the slipped kernel's run, and its twin's in the plain columns
        out = run(slip.make(inp, alpha))
        return out, (None if c.twin_inputs is None
                     else twin_columns(run(slip.make(c.twin_inputs, alpha)), case))

    v0 = judge(out0, c.twin)
    # an oracle that fails the correct kernel (FP8 rows: e4m3 steps exceed its tolerance) fails every slip too: its
    # thresholds and the outputs only it fails would say nothing about the judge
    use = oracle_use(out0.to(truth.value.device), truth.value)
    oracle_ok = oracle_passes(use)
    ref_err = float(torch.linalg.vector_norm(out0.to(truth.value.device, torch.float64) - truth.value))
    tnorm = float(torch.linalg.vector_norm(truth.value))
    res = []
    for slip in slips:
        if slip.lora and getattr(inp, "stacked", True) is None:     # an op-level case always has its LoRA
            continue
        cache: dict = {}

        def at(alpha):
            if alpha not in cache:
                out, twin = slipped(slip, alpha)
                diff = out.to(torch.float64) - out0.to(torch.float64)
                size = float(torch.linalg.vector_norm(diff))
                rows = int((diff != 0).reshape(diff.shape[0], -1).any(dim=1).sum())
                cache[alpha] = (not judge(out, twin).ok, _oracle_fails(out.to(truth.value.device), truth.value),
                                size / ref_err if ref_err > 0 else math.inf, rows)
            return cache[alpha]

        def threshold(which: int) -> Threshold:
            if not at(1.0)[which]:
                return Threshold(None, None, no_effect=at(1.0)[2] == 0)
            lo, hi = 1e-7, 1.0
            if at(lo)[which]:
                return Threshold(lo, at(lo)[2], smallest=True)
            hi = bisect_geometric(lambda a: at(a)[which], lo, hi, steps)
            passed = max((a for a, r in cache.items() if a < hi and not r[which]), default=None)
            return Threshold(hi, at(hi)[2], passed=None if passed is None else at(passed)[2], passed_alpha=passed)

        j = threshold(0)
        o = threshold(1) if oracle_ok else Threshold(None, None)
        missed = [rows for f_j, f_o, _, rows in cache.values() if f_o and not f_j] if oracle_ok else []
        res.append(SlipPower(slip.name, j, o, len(missed), len(cache), max(missed, default=0)))
        if progress:
            progress(f"{slip.name}: judge {j.multiple}, oracle {o.multiple}")
    exact = _accumulator_slips(case, inp, truth, emu.value, precision, judge, oracle_ok) if case.level != "op" else []
    # outputs only the oracle fails count against the judge only where it passes the correct kernel on other draws of
    # the shape too: one that fails a correct kernel there is at its edge, and what it fails says nothing of the judge
    report = PowerReport(case, spec.name, ref_err / tnorm if tnorm else 0.0, v0.ratio, v0.ok, use, res,
                         time.time() - t0, exact, v0.unseen == RULE4_OFF)
    if any(s.oracle_only for s in res) or any(p.oracle_fails and not p.judge_fails for p in exact):
        report.other_draws = oracle_other_draws(spec, case, device, oracle_draws)
        if not report.oracle_ok:
            report.slips = [dataclasses.replace(s, oracle=Threshold(None, None), oracle_only=0, oracle_only_rows=0)
                            for s in res]
            report.precision_slips = [dataclasses.replace(p, oracle_fails=False) for p in exact]
        report.seconds = time.time() - t0
    return report


def _accumulator_slips(case: Case, inp, truth, emu: torch.Tensor, precision: str, judge, oracle_ok: bool) -> list:
    """The working-dtype accumulator at each of ACCUMULATOR_TILES smaller than H, judged: 16-bit dtypes only (an fp32
    accumulator is the contract's; FP8 rows: none, their base GEMMs read e4m3 codes)."""
    from moe_lora_harness.harness.build.builders import torch_dtype
    from moe_lora_harness.harness.build.expert_runner import expert_forward
    dt = torch_dtype(case)
    if case.quant != "none" or dt == torch.float32:
        return []
    base = make_precision(precision, dt)
    forward, args, kw = expert_forward(case, inp)
    own = float(torch.linalg.vector_norm(emu - truth.value))
    out = []
    for tile in (t for t in ACCUMULATOR_TILES if t < case.H):
        got = forward(*args, precision=dataclasses.replace(base, acc_tile=tile), magnitudes=False, **kw).value.to(dt)
        size = float(torch.linalg.vector_norm(got.to(torch.float64) - emu)) / own if own > 0 else math.inf
        out.append(PrecisionSlip(f"dt-accumulator-{tile}", size, not judge(got).ok,
                                 oracle_ok and _oracle_fails(got.to(truth.value.device), truth.value)))
    return out


def _fmt(t: Threshold) -> str:
    x = t.multiple
    if x is None:
        return "no-op" if t.no_effect else "-"
    return ("<=" if t.smallest else "") + (f"{x:.3g}" if x < 1e4 else f"{x:.2e}")


def _missed(s: SlipPower, r: PowerReport) -> str:
    """Where outputs only the oracle failed lie: within one of the judge's declared limits (a mistake confined to
    fewer rows than rule 4 needs; FP8 activations where rule 4 is off at any row count: docs/error-model.md, "What
    the judge cannot see", items 1 and 3) or not."""
    rows = f"{s.oracle_only_rows} row{'' if s.oracle_only_rows == 1 else 's'}"
    few = s.oracle_only_rows < EXCESS_MIN_ROWS
    if _rule4_off(r):
        return (f"up to {rows} changed; FP8 activations: rule 4 is off at any row count"
                f"{' (and fewer rows than it needs)' if few else ''}, the judge's declared limit")
    if few:
        return f"at most {rows} changed: fewer than rule 4 needs, the judge's declared limit"
    return f"up to {rows} changed: enough for rule 4"


def _rule4_off(r: PowerReport) -> bool:
    """Rule 4 judged none of the report's rows (compare.RULE4_OFF: FP8 activations where the e4m3 products are not
    summed exactly, expectation.allowances); a report that did not record it: FP8 activations."""
    return r.rule4_off if r.rule4_off is not None else r.case.quant in FP8_QUANTS


def within_declared_limit(s: SlipPower, r: PowerReport) -> bool:
    """Every output only the oracle failed changed fewer token rows than rule 4 can ever fail (EXCESS_MIN_ROWS), or
    rule 4 judged none of the report's rows (`_rule4_off`)."""
    return s.oracle_only_rows < EXCESS_MIN_ROWS or _rule4_off(r)


def power_table(reports) -> str:
    """One row per (case, slip): the judge's and the oracle's threshold (a multiple of the kernel's own error)."""
    lines = [f"{'case':<44} {'slip':<20} {'judge x':>8} {'oracle x':>9} {'oracle-only':>11}",
             "(x: the smallest failing slip's size as a multiple of the correct kernel's own distance from the truth; "
             "<=: failed at the slip's smallest size; -: not failed even at full size; no-op: the slip changes nothing "
             "on this case; \"its sizes step\": the largest size that passed, where the slip's sizes jump (whole "
             "columns): the threshold lies between the two)"]
    for r in reports:
        c = r.case
        label = f"{c.dtype} T{c.per_call().T}{f'x{c.calls}calls' if c.call_tokens else ''} H{c.H} I{c.I} E{c.E} k{c.top_k} r{c.max_rank}" + (
            f" {c.quant}" if c.quant != "none" else "") + (f" op {c.which}" if c.level == "op" else "")
        lines.append(f"{label:<44} {'(correct kernel)':<20} ratio {r.kernel_ratio:.3g} err {r.kernel_rel_error:.2e}"
                     f" judge {'pass' if r.kernel_ok else 'FAIL'}"
                     f" oracle {'pass' if oracle_passes(r.oracle_use) else 'FAIL'}"
                     f" (its worst element at {r.oracle_use:.2f} of the oracle's tolerance)")
        if r.other_draws:
            lines.append(f"{'':<44} (the correct kernel on {len(r.other_draws)} other draw"
                         f"{'s' if len(r.other_draws) > 1 else ''} of the shape: worst elements at "
                         + ", ".join(f"{u:.2f}" for u in r.other_draws) + ")")
        if not r.oracle_ok:
            lines.append(f"{'':<44} (assert_close fails the correct kernel here"
                         f"{' on another draw' if oracle_passes(r.oracle_use) else ''}: no oracle column, n/a)")
        for s in r.slips:
            oracle, only = (_fmt(s.oracle), s.oracle_only) if r.oracle_ok else ("n/a", "n/a")
            notes = ([f"its sizes step: {s.judge.passed:.3g} passes"] if s.judge.steps else []) + (
                [_missed(s, r)] if r.oracle_ok and s.oracle_only else [])
            lines.append(f"{'':<44} {s.slip:<20} {_fmt(s.judge):>8} {oracle:>9} {only:>11}"
                         + "".join(f"  ({n})" for n in notes))
        for p in r.precision_slips:
            oracle = ("FAIL" if p.oracle_fails else "pass") if r.oracle_ok else "n/a"
            only = int(p.oracle_fails and not p.judge_fails) if r.oracle_ok else "n/a"
            lines.append(f"{'':<44} {p.slip:<20} {'FAIL' if p.judge_fails else 'pass':>8} {oracle:>9} {only:>11}"
                         f"  (size {p.multiple:.3g}x the emulation's own error)")
    return "\n".join(lines)


def to_json(reports) -> list:
    return [dict(case=r.case.to_json(), backend=r.backend, kernel_rel_error=r.kernel_rel_error,
                 kernel_ratio=r.kernel_ratio, kernel_ok=r.kernel_ok, oracle_ok=r.oracle_ok, oracle_use=r.oracle_use,
                 seconds=round(r.seconds, 2), rule4_off=_rule4_off(r), oracle_other_draws=list(r.other_draws),
                 slips=[dict(slip=s.slip, judge_alpha=s.judge.alpha, judge_multiple=s.judge.multiple,
                             judge_passed=s.judge.passed, oracle_passed=s.oracle.passed,
                             judge_smallest=s.judge.smallest, oracle_smallest=s.oracle.smallest,
                             no_effect=s.judge.no_effect or s.oracle.no_effect,   # the output unchanged
                             oracle_alpha=s.oracle.alpha, oracle_multiple=s.oracle.multiple,
                             oracle_only=s.oracle_only, oracle_only_rows=s.oracle_only_rows,
                             evaluated=s.evaluated) for s in r.slips],
                 precision_slips=[dataclasses.asdict(p) for p in r.precision_slips])
            for r in reports]


def power_cases(device: str, layers=(), tokens=(), dtypes=(), ranks=(64,), seed: int = 0, quant: str = "none",
                calls: int = 1, level: str = "expert", tp: int = 1) -> list:
    """The cases of a power table: each catalogued layer's (harness.served.models.MoELayer; TP 1, EP 1) at each token count,
    dtype and rank, every slot at that rank; without layers, one of H 1024, I 512, E 8, top-k 2 (what a CPU computes
    in seconds), at 16 tokens. `quant`: the weights' scheme (an FP8 one quantizes the activations too; the base-GEMM
    slips rewrite the dequantized weights a quantized backend does not read, so they are no-ops there). `calls` > 1:
    each token count is one call's, the case `calls` such calls (Case.call_tokens), judged together. `level` "op":
    the layer's two `fused_moe_lora` calls instead (w13, and w2 with the routing weight, as the expert layer makes
    them), unquantized, one call each. `tp` > 1: the expert layer on that many simulated TP ranks."""
    from moe_lora_harness.harness.served.models import case_fields
    shapes = [case_fields(m) for m in layers] if layers else [
        dict(H=1024, I=512, E=8, top_k=2, activation="silu", bias=False)]
    out = []
    for fields in shapes:
        for T in tokens or (16,):
            for dt in dtypes or (("bfloat16", "float16") if device != "cpu" else ("float16", "float32")):
                for r in ranks:
                    if level == "op":
                        out += [Case(level="op", T=T, dtype=dt, max_rank=r, seed=seed, which=w,
                                     mul_routed_weight=w == "w2", **{k: fields[k] for k in ("H", "I", "E", "top_k")})
                                for w in ("w13", "w2")]
                        continue
                    split = dict(T=T * calls, call_tokens=T) if calls > 1 else dict(T=T)
                    out.append(Case(level="expert", **split, dtype=dt, max_rank=r, seed=seed, quant=quant, tp_size=tp,
                                    **{k: v for k, v in fields.items() if k not in ("tp_size", "ep_size", "ep_rank")}))
    return out
