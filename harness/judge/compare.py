"""The comparison: a kernel's output against the float64 truth, bounded by the rounding-aware emulation.

Error model (docs/error-model.md): over the elements the contract writes,
  1. nothing non-finite where the truth is finite (NaN/Inf never pass);
  2. per element  |out - truth| <= the smaller of the worst case
     ULPS * eps_dt * scale + sqrt(K+R) * eps_fp32 * scale + tiny_dt * underflow + flip, where `scale` is the
     element's forward-error magnitude (|prev| + |w| |B| |A| |x| ...) in float64, `underflow` its exposure to
     gradual underflow (each rounding below dt's smallest normal may add half dt's smallest subnormal `tiny_dt`,
     times what later steps multiply it by: twice that is allowed) and `flip` (FP8 activations only) the absolute
     allowance for e4m3 roundings a correct kernel may take the other way, all at once; and the statistical bound
     centred on the emulation |emu - truth| + eps_dt max(|out|, |emu|) + sigmas(N) sqrt(eps_dt^2 round_var +
     acc_var) + tiny_dt * underflow (every intermediate rounding taken the other way, independently, and the fp32
     accumulation; sigmas(N) makes a false verdict on N elements less likely than FALSE_VERDICT);
  3. in aggregate ||out - truth|| <= RATIO * max(||emulation - truth||, floor) [+ the 1e-9 tail of one more
     rounding of every value, `other_points_norm`, for a kernel not declared to round only at its model's points],
     over the whole tensor and over each token row (dim 0) alone (`row_ratios`), each against its own floor:
     floor = 0.5 eps_dt ||truth|| + accumulation + 0.5 tiny_dt ||underflow|| + max(one_flip) + ||slack_flip||.
     accumulation = ACC_SIGMAS sqrt(sum acc_var): the statistical model of fp32 accumulation (the reference's
     variance bound, reference.accumulation: it grows like the values, sqrt(K), where the worst case grows like K);
     without `acc_var` (FP8 activations on a GPU: the e4m3 MMA accumulates in a 13-bit window, biased) the worst-case
     sqrt(K+R) eps_fp32 ||scale||. `one_flip` (FP8 only) a row's output change from its costliest single flip (the
     emulation's own flips stand for a correct kernel's, except where it has next to none: a small case),
     `slack_flip` (FP8) a row's from the GEMM1 flips only a kernel's fp32 scale arithmetic takes. With a `twin` (below;
     not FP8) a row's accumulation term is at most kappa ||out - twin|| over the row (`twin_terms`), and the base
     at most max(emu, the floor's other terms) + (2/3) kappa ||out - twin|| (`rule3_base`).
  4. the excess over the emulation, across token rows (`excess`, where the statistical model applies): each row's
     D = ||out - truth||^2 - ||emulation - truth||^2 - allowed, allowed = sum of eps_dt^2/12 (round_var + emu^2)
     + ACC_SHARE acc_var (one more rounding of every value the emulation rounds, the output included, and the
     fp32 accumulation's expected square); a correct kernel's D has mean <= 0, a slip's is its squared size; the
     rows' self-normalised sum sum D / sqrt(sum D^2) must stay below EXCESS_SIGMAS (it cannot exceed sqrt(rows):
     silent below EXCESS_MIN_ROWS = 83 rows; a decode batch pools the rows of many calls, Case.call_tokens). It
     holds over every row, each row group's rows, and (with enough rows) every row's elements in each dyadic block
     of columns (harness.judge.column_blocks: a mistake confined to a few columns), under one union bound.
     With a `twin` (the same backend's output on the case's reordered view, every long sum in another order) a
     row's accumulation allowance is the smaller of ACC_SHARE acc_var and TWIN_FACTOR times the two runs' squared
     difference there: the kernel's own accumulation error, measured rather than bounded for every order.
     FP8 activations (where the e4m3 products sum exactly: `flip_sq`): each row also allows its GEMM2 input flips'
     expected square (a Chebyshev bound on each flip's chance; for a backend declared to round at its model's points
     under the twin's cap with the accumulation) and its scale-arithmetic flips (`slack_flip`) in full.
Elements the contract does not write are compared bit for bit with what the buffer held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe_lora_harness.harness.build.guards import bits_dtype      # a tensor's bits, for the bit-exact rules
from moe_lora_harness.harness.build.properties import plain_rows   # a view's rows in the plain run's order
from moe_lora_harness.harness.judge.column_blocks import ColumnBlocks, column_blocks   # rule 4's column sets
from moe_lora_harness.reference.precision import spacing_sq, tiny   # rule 4's rounding and underflow units

ULPS = 4.0     # per element, in units of eps_dt at the element's forward-error scale
RATIO = 3.0    # aggregate: at most this many times farther from the truth than the emulation
# the accumulation term of the floor, in standard deviations of the reference's variance bound (acc_var): the bound
# takes each fp32 rounding error's variance as u^2 where round-to-nearest's is at most u^2/3, so RATIO x ACC_SIGMAS
# is 6.2 standard deviations of a correct kernel's accumulation error even when all of it lies in one direction
# (a Gaussian tail of 6.1 sigma: 1e-9); docs/error-model.md, "The statistical model"
ACC_SIGMAS = 1.2
# rule 4 compares mean squares, so it allows the accumulation's expected square, not its bound: for products in an
# order independent of their values E sum_v S_v^2 is at most 0.625 of dot_variance's n (y^2 + sum p^2) (a drift of
# n = 2 terms; 0.52 from n = 3, a third for large n) and round-to-nearest errs uniformly within half a spacing (a third
# of u^2 S^2, as ACC_SIGMAS takes it): at most 0.21 of acc_var. Sequential fp32 loops measured 0.003-0.095
# (suites/harness/test_statistical_model.py); docs/error-model.md, "The accumulation's share in rule 4"
ACC_SHARE = 0.25
# rule 4 with a twin run (the reordered view): two summation orders' accumulation errors a and b, each of expected
# square X, differ by E|a - b|^2 = 2 X (1 - rho); TWIN_FACTOR |a - b|^2 covers X while their correlation rho stays
# under 2/3. Independent roundings of different partial sums have rho 0 (measured: the twins' squared difference
# is 0.94-1.02 of 2 X on the CPU, 0.83-0.95 on the H100): docs/error-model.md, "The twin run"
TWIN_FACTOR = 1.5
# the largest correlation of the two runs' accumulation errors TWIN_FACTOR covers: rule 3's twin floor assumes the same
TWIN_RHO = 1.0 - 1.0 / (2.0 * TWIN_FACTOR)
FALSE_VERDICT = 1e-9    # the per-case chance of a false per-element verdict the statistical bound allows
# rule 4: a self-normalised sum of independent rows exceeds z with probability below exp(-z^2/2) when the rows' excesses
# are symmetric (Efron 1969), and in general below that at z sqrt(2) once their squares estimate their variances
# (Bercu and Touati 2008): 6.44 sqrt(2) for FALSE_VERDICT. docs/error-model.md, "The excess over the emulation"
def excess_sigmas(tests: float = 1) -> float:
    """Rule 4's threshold when it is tried on `tests` sets of rows (a union bound: each at FALSE_VERDICT / tests; a
    fraction f of FALSE_VERDICT over n sets: tests n / f)."""
    return math.sqrt(2.0 * 2.0 * math.log(max(float(tests), 1.0) / FALSE_VERDICT))


EXCESS_SIGMAS = excess_sigmas(1)
# rule 4 over column blocks (harness.judge.column_blocks): their share of rule 4's FALSE_VERDICT, the row sets keeping
# the rest; tried only where every row's count lets them fail (docs/error-model.md, "Rule 4 over column blocks")
COLUMN_SHARE = 0.1
# rule 4's statistic is at most sqrt(rows): below this many rows it cannot fail (a decode call's rows; Case.call_tokens
# pools calls until it can)
EXCESS_MIN_ROWS = math.ceil(EXCESS_SIGMAS ** 2)


def other_points_tail(tests: int = 1) -> float:
    """Rule 3's factor c on a row's sqrt(sum a) (a: `other_points`) below which the error of one more rounding at
    every value stays, with probability 1 - FALSE_VERDICT / tests, whatever its covariance within the row (the
    Hsu-Kakade-Zhang tail of a sub-Gaussian vector's norm with the largest eigenvalue at the trace: c^2 = 1 + 2 sqrt(t)
    + 2 t, t = ln(tests / FALSE_VERDICT)). docs/error-model.md, "Rule 3 for a kernel that rounds at other points"."""
    t = math.log(max(int(tests), 1) / FALSE_VERDICT)
    return math.sqrt(1.0 + 2.0 * math.sqrt(t) + 2.0 * t)


def other_points_norm(row_traces: torch.Tensor, tests: int = 1) -> float:
    """The same bound for a tensor whose rows (tokens) round independently, as rule 4 takes them: its covariance is
    block-diagonal, each block's square trace at most its trace squared and its largest eigenvalue at most the
    largest block's trace: sqrt(tr + 2 sqrt(t sum_r A_r^2) + 2 t max_r A_r), A_r each row's sum of a. One row:
    other_points_tail(tests) sqrt(A_r)."""
    t = math.log(max(int(tests), 1) / FALSE_VERDICT)
    a = row_traces.to(torch.float64).clamp_min(0)
    tr = float(a.sum())
    if tr <= 0:
        return 0.0
    return math.sqrt(tr + 2.0 * math.sqrt(t * float((a * a).sum())) + 2.0 * t * float(a.max()))


def other_points(emulation: torch.Tensor, round_var: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, the variance of one more rounding of every value the emulation rounds, the output included
    (uniform within half of dt's spacing there: eps_dt^2 / 12 times the spacing exposure): what a correct kernel that
    rounds at other points than its model may add (rules 3 and 4)."""
    eps_dt = _eps(dtype)
    return eps_dt * eps_dt / 12.0 * (round_var.clamp_min(0) + spacing_sq(emulation))


def other_points_rows(emulation: torch.Tensor, round_var: torch.Tensor | None, written: torch.Tensor,
                      dtype: torch.dtype, model_points_only: bool) -> torch.Tensor | None:
    """Each row's (dim 0; a 1-D tensor is one row) sum of `other_points` over its written elements, whose tail rule 3
    adds for a kernel that may round at other points than its model; None where it adds none (the backend declares
    model_points_only, or no round_var is carried: FP8 activations)."""
    if round_var is None or model_points_only:
        return None
    a = torch.where(written, other_points(emulation, round_var, dtype), torch.zeros_like(emulation))
    return a.sum(dim=tuple(range(1, a.dim()))) if a.dim() > 1 else a.sum().reshape(1)


def rule3_tests(truth: torch.Tensor) -> int:
    """How many comparisons rule 3 makes of one output (each row and the whole tensor): the other-points tails'
    union bound."""
    return truth.shape[0] + 1 if truth.dim() > 1 else 1


def sigmas(n: int) -> float:
    """Standard deviations beyond which any of `n` sub-Gaussian errors lies with probability below FALSE_VERDICT
    (a union bound over the elements of Hoeffding's tail 2 exp(-l^2 / 2))."""
    return math.sqrt(2.0 * math.log(2.0 * max(int(n), 1) / FALSE_VERDICT))
EPS32 = torch.finfo(torch.float32).eps


@dataclass
class Verdict:
    """Result of one comparison; `ok` is the verdict, the rest is diagnostics."""

    ok: bool
    kind: str = "pass"              # pass | nonfinite | untouched | element | aggregate | shape
    message: str = ""
    ratio: float = 0.0              # aggregate ratio (kernel error / allowed base)
    max_ulps: float = 0.0           # worst per-element error in units of the per-element bound
    worst: list = field(default_factory=list)   # [(index tuple, out, truth, emulation, bound)]
    excess: float = 0.0             # rule 4's self-normalised excess over the emulation, in EXCESS_SIGMAS
    unseen: str = ""                # the row sets rule 4 could not judge (too few rows): rules 2 and 3 alone there

    def summary(self) -> str:
        return (f"{self.kind}: ratio={self.ratio:.3g} (<= {RATIO}), worst element at {self.max_ulps:.3g}x its bound, "
                f"excess {self.excess:.3g} (<= 1)" + (f"; {self.unseen}" if self.unseen else ""))


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _fmt_worst(idx_tensor, out, truth, emu, bound, names, limit=6):
    rows = []
    for i in range(min(limit, idx_tensor.shape[0])):
        idx = tuple(int(v) for v in idx_tensor[i])
        rows.append((idx, float(out[idx]), float(truth[idx]), float(emu[idx]), float(bound[idx])))
    return rows


def element_bound(scale: torch.Tensor, *, dtype: torch.dtype, k_plus_r: int, underflow: torch.Tensor | None = None,
                  work_dtype: torch.dtype | None = None, flip: torch.Tensor | None = None) -> torch.Tensor:
    """Each element's allowed |out - truth| (rule 2 of the error model), never 0 (the smallest float64)."""
    bound = ULPS * _eps(dtype) * scale + math.sqrt(max(k_plus_r, 1)) * EPS32 * scale
    if underflow is not None:
        bound = bound + tiny(work_dtype or dtype) * underflow
    if flip is not None:
        bound = bound + flip
    return torch.where(bound > 0, bound, torch.full_like(bound, torch.finfo(torch.float64).tiny))


def statistical_bound(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, acc_var: torch.Tensor,
                      round_var: torch.Tensor, *, dtype: torch.dtype, n: int, underflow: torch.Tensor | None = None,
                      work_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Each element's allowed |out - truth| under the statistical model, centred on the emulation (rule 2's second
    form): the emulation's own error, one rounding of the output the other way, and sigmas(n) standard deviations of
    the intermediate roundings (each may go the other way: a step of at most eps_dt of its value, independent signs)
    and the fp32 accumulation. docs/error-model.md, "The statistical model"."""
    eps_dt = _eps(dtype)
    sd = (eps_dt * eps_dt * round_var.clamp_min(0) + acc_var.clamp_min(0)).sqrt()
    bound = ((emulation - truth).abs() + eps_dt * torch.maximum(out64.abs(), emulation.abs()) + sigmas(n) * sd)
    if underflow is not None:
        bound = bound + tiny(work_dtype or dtype) * underflow
    return bound


def rule2_bound(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, scale: torch.Tensor,
                written: torch.Tensor, *, dtype: torch.dtype, k_plus_r: int, underflow: torch.Tensor | None = None,
                work_dtype: torch.dtype | None = None, flip: torch.Tensor | None = None,
                acc_var: torch.Tensor | None = None, round_var: torch.Tensor | None = None, **_) -> torch.Tensor:
    """Rule 2's per-element bound as the verdict applies it: the worst case, the smaller of it and the statistical
    bound where the model applies (`acc_var` and `round_var`, over the written elements' count; not with FP8
    `flip`s). The other keywords compare_written takes are accepted and ignored, so that one set of them serves
    both."""
    bound = element_bound(scale, dtype=dtype, k_plus_r=k_plus_r, underflow=underflow, work_dtype=work_dtype, flip=flip)
    if acc_var is not None and round_var is not None and flip is None:   # FP8: a flip is no sub-Gaussian step
        stat = statistical_bound(out64, truth, emulation, acc_var, round_var, dtype=dtype, n=int(written.sum()),
                                 underflow=underflow, work_dtype=work_dtype)
        bound = torch.minimum(bound, stat)
    return bound


def compare_written(out: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, scale: torch.Tensor,
                    written: torch.Tensor, *, dtype: torch.dtype, k_plus_r: int,
                    before: torch.Tensor | None = None, names=("t", "j", "col"),
                    underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
                    flip: torch.Tensor | None = None, one_flip: torch.Tensor | None = None,
                    slack_flip: torch.Tensor | None = None, acc_var: torch.Tensor | None = None,
                    round_var: torch.Tensor | None = None, row_groups=None,
                    model_points_only: bool = False, twin: torch.Tensor | None = None,
                    flip_sq: torch.Tensor | None = None, twin_sources: int | None = None) -> Verdict:
    """Compare `out` (the kernel's buffer, any float dtype) with the float64 truth under the error model.

    `written` marks elements the contract writes; elsewhere `out` must equal `before` bit for bit
    (when `before` is given). `underflow` (the reference's exposure, None: no allowance) is in half
    subnormal spacings of `work_dtype`, the dtype the kernel rounds to (default `dtype`, the bound's).
    `flip` (T, H), `one_flip` and `slack_flip` (T,) (the reference's ExpertExpected fields, absolute; None: none)
    widen the per-element bound and the aggregate floor. `acc_var` (the truth's, None: the worst-case accumulation
    term) gives the floor's statistical accumulation term; with `round_var` too, the per-element bound is the smaller
    of the worst case and the statistical one. Rule 3 holds for each row (dim 0) too (`row_ratios`). `row_groups`
    (labellings of the rows, name -> labels: each token's LoRA slot, its routed experts; a bare tensor: the slots)
    makes rule 4 hold for each label's rows too. `model_points_only` (the backend declares that it rounds where its
    model rounds and nowhere else): rule 4 allows the accumulation alone, not one more rounding of every value.
    `twin` (the backend's output on the reordered view, in this output's column order): rule 4's accumulation
    allowance is at most TWIN_FACTOR times the two runs' squared difference, and rule 3's accumulation term of a row
    at most kappa times their distance there, kappa counting at most `twin_sources` elements a row. `flip_sq`
    (T, 2; FP8, with `round_var`: reference.experts.ExpertExpected.flip_sq) turns rule 4 on for FP8 rows, each row
    allowed its flips' expected square (and `slack_flip`'s); without it FP8 rows have rules 2 and 3 alone. Computed
    where `truth` lies (a CUDA judge's device): the other tensors are moved there.
    """
    if tuple(out.shape) != tuple(truth.shape):
        return Verdict(False, "shape", f"output shape {tuple(out.shape)} != expected {tuple(truth.shape)}")
    dev = truth.device
    o = out.detach().to(dev)
    written = written.to(dev).bool()
    emulation, scale = emulation.to(dev), scale.to(dev)
    underflow = underflow.to(dev) if underflow is not None else None
    flip = flip.to(dev) if flip is not None else None
    acc_var = acc_var.to(dev) if acc_var is not None else None
    round_var = round_var.to(dev) if round_var is not None else None
    if before is not None:
        b = before.detach().to(dev)
        if o.dtype != b.dtype:
            return Verdict(False, "shape", f"output dtype {o.dtype} != the buffer's original dtype {b.dtype}")
        same = same_bits(o, b)
        bad = (~written) & (~same)
        if bad.any():
            idx = bad.nonzero()[:6]
            ex = ", ".join(f"{tuple(int(v) for v in i)}: {float(o[tuple(i)]):.6g} (was {float(b[tuple(i)]):.6g})"
                           for i in idx)
            return Verdict(False, "untouched",
                           f"{int(bad.sum())} element(s) the contract never writes were changed; "
                           f"first at ({', '.join(names)}): {ex}")
    o64 = o.to(torch.float64)
    if written.sum() == 0:
        return Verdict(True, "pass", "no element is written by the contract; untouched elements verified bit-exact")
    ow, tw, ew, sw = o64[written], truth[written], emulation[written], scale[written]
    nonfinite = ~torch.isfinite(ow) & torch.isfinite(tw)
    if nonfinite.any():
        idx = (written & ~torch.isfinite(o64)).nonzero()[:6]
        ex = ", ".join(f"{tuple(int(v) for v in i)}={float(o64[tuple(i)])}" for i in idx)
        return Verdict(False, "nonfinite",
                       f"{int(nonfinite.sum())} written element(s) are NaN/Inf (unwritten, overflow, or a read "
                       f"past an input's end, where the guard bands hold NaN); first at ({', '.join(names)}): {ex}")
    eps_dt = _eps(dtype)
    acc = math.sqrt(max(k_plus_r, 1)) * EPS32
    bound = rule2_bound(o64, truth, emulation, scale, written, dtype=dtype, k_plus_r=k_plus_r, underflow=underflow,
                        work_dtype=work_dtype, flip=flip, acc_var=acc_var, round_var=round_var)
    under_w = None
    if underflow is not None:
        t_dt = tiny(work_dtype or dtype)
        under_w = underflow[written]
    err = (o64 - truth).abs()
    rel = torch.where(written, err / bound, torch.zeros_like(err))
    max_ulps = float(rel.max())
    kern = float(torch.linalg.vector_norm(ow - tw))
    emu = float(torch.linalg.vector_norm(ew - tw))
    whole_acc = (ACC_SIGMAS * math.sqrt(float(acc_var[written].clamp_min(0).sum())) if acc_var is not None
                 else acc * float(torch.linalg.vector_norm(sw)))
    twin_whole = None    # the whole tensor's accumulation term as the twin measured it (None: no twin)
    whole_measured = None
    if twin is not None and acc_var is not None and flip is None:     # the whole tensor as one row of rule 3's
        flat = lambda t: t.reshape(1, -1)  # noqa: E731
        whole_measured = twin_terms(flat(o64), flat(twin.detach().to(dev)), flat(acc_var), flat(written),
                                 rule3_tests(truth), None if twin_sources is None
                                 else twin_sources * int(_live_rows(written).sum()))
        measured = float(whole_measured[0])
        twin_whole = measured if measured < whole_acc else None
    floor = 0.5 * eps_dt * float(torch.linalg.vector_norm(tw))
    if under_w is not None:
        floor += 0.5 * t_dt * float(torch.linalg.vector_norm(under_w))
    if one_flip is not None and one_flip.numel():
        floor += float(one_flip.max())
    if slack_flip is not None:
        floor += float(torch.linalg.vector_norm(slack_flip.to(torch.float64)))
    # a kernel that may round at other points than its model: their error has its own tail, added (rule 3; FP8: its
    # factor 3 over the flip floor, as before rule 4 judged FP8 rows)
    other_rows = other_points_rows(emulation, round_var if flip is None else None, written, dtype, model_points_only)
    f64 = lambda v: torch.as_tensor(v, dtype=torch.float64)  # noqa: E731
    base = float(rule3_base(f64(emu), f64(floor), f64(whole_acc), whole_measured))
    floor += whole_acc if twin_whole is None else twin_whole     # as the message reports it
    base += 0.0 if other_rows is None else other_points_norm(other_rows, rule3_tests(truth)) / RATIO
    ratio = kern / base if base > 0 else (0.0 if kern == 0 else math.inf)
    row, row_ratio = None, 0.0
    twin_acc = None      # the worst row's accumulation term as the twin measured it (None: no twin)
    if truth.dim() > 1 and truth.shape[0] > 1:
        one_flip_d = one_flip.to(dev) if one_flip is not None else None
        slack_d = slack_flip.to(dev) if slack_flip is not None else None

        def ratios(idx=None, measured=None):     # rule 3 of the rows idx (None: all), held to the twin's terms
            cut = (lambda t: t) if idx is None else (lambda t: None if t is None else t[idx])  # noqa: E731
            return row_ratios(cut(o64), cut(truth), cut(emulation), cut(scale), cut(written), cut(one_flip_d),
                              dtype=dtype, k_plus_r=k_plus_r, underflow=cut(underflow), work_dtype=work_dtype,
                              slack_flip=cut(slack_d), acc_var=cut(acc_var), other_rows=cut(other_rows),
                              twin_acc=measured, tests=rule3_tests(truth))
        if twin is not None and acc_var is not None and flip is None:
            row, row_ratio, twin_acc = _worst_row_with_twin(o64, twin.detach().to(dev), acc_var, written,
                                                            rule3_tests(truth), ratios, twin_sources)
        else:
            rows = ratios()
            row = int(rows.argmax())
            row_ratio = float(rows[row])
    order = torch.topk(rel.flatten(), min(6, rel.numel())).indices   # the worst six, largest first
    idx = _unravel(order, rel.shape)
    worst = _fmt_worst(idx, o64, truth, emulation, bound, names)
    agg = max(ratio, row_ratio)      # the aggregate statistic: the whole tensor's, or its worst row's
    # rule 4 holds (FP8 activations: with their flips' expected square only)
    modelled = acc_var is not None and round_var is not None and (flip is None or flip_sq is not None)
    sets = _judged_sets(row_groups, _live_rows(written), _width(truth)) if modelled and truth.dim() > 1 else None
    exc = excess(o64, truth, emulation, written, acc_var, round_var, dtype=dtype, underflow=underflow,
                 work_dtype=work_dtype, row_groups=row_groups, model_points_only=model_points_only, sets=sets,
                 twin=None if twin is None else twin.detach().to(dev),
                 flips=None if flip is None else (flip_sq.to(dev), slack_flip)) if modelled else None
    x = 0.0 if exc is None else exc[0]
    unseen = _unseen(sets) if sets is not None else (
        RULE4_OFF if not modelled and truth.dim() > 1 and int(_live_rows(written).sum()) > 1 else "")
    if max_ulps > 1.0:
        return Verdict(False, "element", f"{int((rel > 1).sum())} element(s) exceed the per-element bound "
                       f"(worst {max_ulps:.3g}x); aggregate ratio {agg:.3g}", agg, max_ulps, worst, x, unseen)
    if ratio > RATIO:
        return Verdict(False, "aggregate", f"aggregate error {kern:.3g} is {ratio:.3g}x the emulation's "
                       f"{emu:.3g} (floor {floor:.3g}" + _measured_by_twin(twin_whole)
                       + ("" if other_rows is None else ", plus the tail of other rounding points")
                       + f"); bound {RATIO}",
                       agg, max_ulps, worst, x, unseen)
    if row_ratio > RATIO:
        return Verdict(False, "aggregate", f"row {names[0]}={row}'s aggregate error is {row_ratio:.3g}x the larger "
                       f"of its emulation's and its floor (rule 3 per token row{_measured_by_twin(twin_acc)}); "
                       f"bound {RATIO}; "
                       f"the whole tensor's ratio {ratio:.3g}", agg, max_ulps, worst, x, unseen)
    if x > 1.0:
        _, rows_over, n_rows, extra, where = exc
        acc = ("its fp32 accumulation as its twin run measured it (the case reordered, each long sum in another "
               "order)" if twin is not None else "its fp32 accumulation")
        allowance = (f"{acc} (the backend declares it rounds only where its model rounds)"
                     if model_points_only else f"one more rounding of every value it rounds and {acc}")
        return Verdict(False, "aggregate", f"the output is farther from the truth than the emulation plus {allowance}, "
                       f"consistently across rows (rule 4): over {where}, "
                       f"{rows_over} of {n_rows} rows exceed it, "
                       + (f"by {extra:.3g} of the allowance in all; " if extra < 1e6
                          else "where the allowance is all but zero; ")
                       + f"self-normalised excess {x:.3g}x its bound; aggregate ratio {agg:.3g}",
                       agg, max_ulps, worst, x, unseen)
    return Verdict(True, "pass", "", agg, max_ulps, worst, x, unseen)


def excess(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, written: torch.Tensor,
           acc_var: torch.Tensor, round_var: torch.Tensor, *, dtype: torch.dtype,
           underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
           row_groups=None, model_points_only: bool = False, sets=None, twin: torch.Tensor | None = None,
           flips=None):
    """Rule 4: (statistic, rows whose excess is positive, rows, total excess over total allowance, which rows) for
    the worst of the sets tried: every row (dim 0) with a written element, each `row_groups` label's rows, and (with
    enough rows) every row's elements in each column block (`_judged_sets`). The statistic is sum D / (z sqrt(sum
    D^2)), D a row's squared error minus the emulation's minus its allowance over the set's columns, z the set's
    threshold (excess_sigmas under the union bound); > 1 fails. A 1-D output has none. `model_points_only`: the
    allowance is the accumulation's alone (a kernel that rounds exactly where its model does flips roundings, a
    mean-zero change: docs/error-model.md). `sets`: `_judged_sets` of these rows, groups and width, when the caller
    has them already. `twin`: compare_written's. `flips` (FP8): (flip_sq, slack_flip), row_excess's."""
    if truth.dim() < 2:
        return 0.0, 0, 1, 0.0, "no rows"
    live = _live_rows(written)
    names, _, member, sizes, keep, z, _, columns = (sets if sets is not None
                                                    else _judged_sets(row_groups, live, _width(truth)))
    terms = _excess_terms(out64, truth, emulation, written, acc_var, round_var, dtype=dtype, underflow=underflow,
                          work_dtype=work_dtype, model_points_only=model_points_only, twin=twin, flips=flips,
                          blocks=columns)
    d, a = (x[:, 0] for x in _set_excess(terms, torch.ones(terms["e"].shape[1], 1, dtype=torch.float64,
                                                               device=truth.device)))
    m = member[:, keep]
    found = _set_statistics(d[:, None] * m, a[:, None] * m, [(z, names[i], int(sizes[i])) for i in keep])
    if columns is not None:   # every live row, restricted to each block's columns
        dc, ac = _set_excess(terms, columns.member.to(truth.device))
        lm = live.to(torch.float64)[:, None]
        n_live = int(live.sum())
        found += _set_statistics(dc * lm, ac * lm, [(columns.z, columns.name(i), n_live)
                                                    for i in range(len(columns.spans))])
    return max(found, key=lambda f: f[0])     # the first (every row) among equals


def _set_statistics(dm: torch.Tensor, am: torch.Tensor, sets: list) -> list:
    """Rule 4's findings for sets of rows whose weighted excesses `dm` and allowances `am` are (rows, sets) columns:
    [(statistic, rows over, rows, total excess over total allowance, name)]; `sets` [(threshold, name, rows)]."""
    total, spread = dm.sum(dim=0), torch.linalg.vector_norm(dm, dim=0)
    over, allow = (dm > 0).to(torch.float64).sum(dim=0), am.sum(dim=0)
    return [(self_normalised(t, sp, z), int(o), n, t / al if al > 0 else math.inf, name)
            for t, sp, o, al, (z, name, n) in zip(*(x.tolist() for x in (total, spread, over, allow)), sets)]


def self_normalised(total: float, spread: float, z: float) -> float:
    """Rule 4's statistic of a set from its rows' (weighted) excesses: their sum over z times their root sum of
    squares (> 1 fails); 0 where the sum is not positive."""
    return total / (z * spread) if total > 0 and spread > 0 else 0.0


def row_excess(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, written: torch.Tensor,
               acc_var: torch.Tensor, round_var: torch.Tensor, *, dtype: torch.dtype,
               underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
               model_points_only: bool = False, twin: torch.Tensor | None = None,
               flips=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 4's per-row terms over the written elements of each row (dim 0): (D, the row's squared error minus the
    emulation's minus its allowance; the allowance). With a `twin` run each row's accumulation allowance is the
    smaller of ACC_SHARE acc_var and TWIN_FACTOR times the runs' squared difference, over the row. `flips` (FP8
    activations): (flip_sq (T, ..., 2): each element's expected square of its change from GEMM2's input flips,
    slack_flip (T,) or None): each row also allows its elements' flips (column 0 for a kernel declared to round at
    its model's points, with the accumulation under the twin's cap: the twin flips as it does; else column 1,
    uncapped) and, unless it is so declared (its scale is amax / 448 and its operand x / s, each rounded once, as
    the model's), its scale-arithmetic flips in full, slack^2 + 2 slack ||emu - truth|| (certain flips need not be
    mean-zero). docs/error-model.md, "FP8 rows in rule 4"."""
    terms = _excess_terms(out64, truth, emulation, written, acc_var, round_var, dtype=dtype, underflow=underflow,
                          work_dtype=work_dtype, model_points_only=model_points_only, twin=twin, flips=flips)
    d, a = _set_excess(terms, torch.ones(1, 1, dtype=torch.float64, device=truth.device))
    return d[:, 0], a[:, 0]


def _excess_terms(out64, truth, emulation, written, acc_var, round_var, *, dtype, underflow=None, work_dtype=None,
                  model_points_only=False, twin=None, flips=None, blocks: ColumnBlocks | None = None) -> dict:
    """Rule 4's terms of each row, summed over each unit of `blocks` (None: the whole row, one unit), (rows,
    units) each: "e" the squared error minus the emulation's minus the per-element allowance, "x" the accumulation's
    share (with a declared backend's FP8 flips), "y" the twin's cap (None: no twin), "f" the other FP8 flips (None:
    none), "m" the emulation's squared error, "a" the per-element allowance; "slack" (rows,) the scale-arithmetic
    flips' norm, allowed in full over any set of a row's columns (None: none). `row_excess` says what each holds."""
    w = written
    zero = torch.zeros((), dtype=torch.float64, device=truth.device)
    sums = (lambda x: torch.where(w, x, zero).reshape(x.shape[0], -1).sum(dim=1, keepdim=True)) if blocks is None \
        else (lambda x: blocks.sums(torch.where(w, x, zero)))
    flip_sq, slack = flips if flips is not None else (None, None)
    acc = ACC_SHARE * acc_var.clamp_min(0)
    if flip_sq is not None and model_points_only:   # the flips a twin in another order takes too: measured with it
        acc = acc + flip_sq[..., 0].to(acc)
    y = None
    if twin is not None:
        apart = torch.nan_to_num((out64 - twin.to(torch.float64)) ** 2, nan=math.inf, posinf=math.inf)
        y = sums(TWIN_FACTOR * apart)
    f = None
    if flip_sq is not None and not model_points_only:   # another rounding's flips need not differ between orders
        f = sums(flip_sq[..., 1].to(acc))
    # the scale arithmetic's flips at exact ties: in full (neither the order's nor random); a backend that rounds only
    # at its model's points divides as the model does
    slack = slack.to(acc) if slack is not None and not model_points_only else None
    allowed = torch.zeros_like(truth)
    if not model_points_only:
        allowed = allowed + other_points(emulation, round_var, dtype)
    if underflow is not None:
        allowed = allowed + (tiny(work_dtype or dtype) * underflow) ** 2
    sq = (emulation - truth) ** 2
    return dict(e=sums((out64 - truth) ** 2 - sq - allowed), x=sums(acc), y=y, f=f, m=sums(sq), a=sums(allowed),
                slack=slack)


def _set_excess(terms: dict, member: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, allowance) (rows, sets) of `_excess_terms` over the units of each set (`member` (units, sets) 0/1): the
    twin's cap and the slack's cross term taken per set, where they do not add."""
    def over(x: torch.Tensor) -> torch.Tensor:    # a set's sum; inf where a unit in it is (never inf times 0)
        inf = torch.isinf(x)
        return torch.where((inf.to(x.dtype) @ member) > 0, math.inf, torch.where(inf, 0.0, x) @ member)
    acc = over(terms["x"])
    if terms["y"] is not None:
        acc = torch.minimum(acc, over(terms["y"]))
    if terms["f"] is not None:
        acc = acc + over(terms["f"])
    slack = terms["slack"]
    if slack is not None:
        acc = acc + slack[:, None] ** 2 + 2.0 * slack[:, None] * over(terms["m"]).clamp_min(0).sqrt()
    return over(terms["e"]) - acc, over(terms["a"]) + acc


def _width(truth: torch.Tensor) -> int:
    """An output row's (dim 0) flattened column count: what rule 4's column blocks divide."""
    return truth[0].numel() if truth.dim() > 1 else 0


def _live_rows(written: torch.Tensor) -> torch.Tensor:
    """The rows (dim 0) with a written element: the rows rule 4 judges."""
    return written.reshape(written.shape[0], -1).any(dim=1)


def _judged_sets(row_groups, live: torch.Tensor, width: int = 0):
    """(names, kinds, row weights, sizes, kept set indices, threshold, the threshold sets were dropped at, column
    sets): rule 4's row sets (`_row_sets`) and those it judges, and its column blocks of a row `width` columns wide
    (`ColumnSets`, None where there are none or they cannot fail). A set of n rows cannot fail (the statistic is at
    most sqrt(n), with any weights): dropped before the union bound counts it (the sets follow the routing, the
    mapping and the row's width, never the output judged); every row (set 0) is always kept. With column blocks the
    row sets take 1 - COLUMN_SHARE of FALSE_VERDICT."""
    names, kinds, member = _row_sets(row_groups, live)    # member: (rows, sets) weights, "every row" first
    sizes = (member > 0).sum(dim=0).tolist()
    z_drop = excess_sigmas(len(sizes))
    keep = [0] + [i for i in range(1, len(sizes)) if math.sqrt(sizes[i]) > z_drop]
    columns = _column_sets(width, int(sizes[0]))
    share = 1.0 if columns is None else 1.0 - COLUMN_SHARE
    return names, kinds, member, sizes, keep, excess_sigmas(len(keep) / share), z_drop, columns


@dataclass(frozen=True)
class ColumnSets(ColumnBlocks):
    """Rule 4's column blocks (`column_blocks`) with their threshold `z`: COLUMN_SHARE of FALSE_VERDICT over them."""

    z: float = 0.0


def _column_sets(width: int, rows: int) -> ColumnSets | None:
    """The column blocks rule 4 tries on `rows` live rows `width` columns wide; None where a row is narrower than
    two blocks, or where sqrt(rows) is within their threshold (none could fail)."""
    blocks = column_blocks(width) if width > 0 else None
    if blocks is None:
        return None
    z = excess_sigmas(len(blocks.spans) / COLUMN_SHARE)
    if math.sqrt(rows) <= z:
        return None
    return ColumnSets(blocks.width, blocks.unit, blocks.member, blocks.spans, z)


# a verdict's `unseen` where the truth carries no rounding-variance model (FP8 activations: their e4m3 steps are rule
# 2's flip terms), so rule 4 judges no row
RULE4_OFF = ("rule 4 is off (the truth carries no rounding-variance model, as with FP8 activations under an undeclared "
             "e4m3 accumulation, or a truncating one without a twin run): rules 2 and 3 alone judge every row")


def rule4_unseen(written: torch.Tensor, row_groups=None) -> str:
    """Which of rule 4's row sets hold too few rows for it to fail (`_judged_sets`), in words ('' when it judges every
    one): there a mistake confined to those rows is judged by rules 2 and 3 alone, whose aggregate factor 3 lets one
    up to about 2.8 times the rows' own error pass (docs/error-model.md, "What the judge cannot see")."""
    return _unseen(_judged_sets(row_groups, _live_rows(written), _width(written))) if written.dim() > 1 else ""


def _unseen(sets) -> str:
    """`rule4_unseen`'s words for the `_judged_sets` already taken."""
    _, kinds, _, sizes, keep, z, z_drop, _ = sets
    parts = [f"every row ({sizes[0]} rows, it needs {math.floor(z * z) + 1})"] if math.sqrt(sizes[0]) <= z else []
    kept = set(keep)
    dropped: dict[str, list] = {}
    for i, kind in enumerate(kinds[1:], 1):
        dropped.setdefault(kind, [0, 0])[1] += 1
        dropped[kind][0] += i not in kept
    parts += [f"{d} of {n} {kind} sets (each under {math.floor(z_drop * z_drop) + 1} rows)"
              for kind, (d, n) in dropped.items() if d]
    return ("rule 4 cannot fail over " + ", ".join(parts) + ": rules 2 and 3 alone judge a mistake confined there"
            ) if parts else ""


@dataclass(frozen=True)
class ByInverseWeight:
    """A labelling of rule 4's rows whose sets weight each row by the inverse of the row's weight for the label (a
    token's routing weight to an expert): a mistake in one expert's computation reaches each of its rows scaled by
    that weight, so the plain sum over its rows is held back by their unevenness (at most sqrt(n) E[w^2] / sqrt(E[w^4])
    of a slip that dominates) and can miss it at any size; weighted, the rows contribute evenly. Weights fixed by the
    routing keep the rule's tail (docs/error-model.md, "Rule 4 over an expert's rows, weighted")."""

    labels: torch.Tensor       # (rows, m)
    weights: torch.Tensor      # (rows, m): each label's weight in the row (a row's weight for a label: their sum)
    of: str                    # what the labels are, for the sets' names

    def clone(self) -> "ByInverseWeight":
        return ByInverseWeight(self.labels.clone(), self.weights.clone(), self.of)


def _row_sets(row_groups, live: torch.Tensor) -> tuple[list, list, torch.Tensor]:
    """Rule 4's row sets: (names, kinds, (rows, sets) float64 row weights), every live row first, then for each
    labelling (kind -> labels, (rows,) or (rows, m): a row is in the set of each of its labels, weight 1; or a
    ByInverseWeight) the live rows of each label that are neither one row nor all of them. A bare tensor is the
    tokens' LoRA slots."""
    names, kinds, cols = ["every row"], ["every row"], [live[:, None].to(torch.float64)]
    if isinstance(row_groups, torch.Tensor):
        row_groups = {"LoRA slot": row_groups}
    n_live = int(live.sum())
    for kind, labels in (row_groups or {}).items():
        weighted = isinstance(labels, ByInverseWeight)
        g = labels.labels if weighted else labels
        if n_live < 3 or g is None or g.shape[0] != live.numel():
            continue
        g = g.to(live.device)
        g = g[:, None] if g.dim() == 1 else g.reshape(g.shape[0], -1)
        values, where = torch.unique(g, return_inverse=True)          # a label only dead rows hold has n = 0 below
        per = torch.zeros(g.shape[0], values.numel(), dtype=torch.float64, device=g.device)
        if weighted:     # a row's weight for a label: the sum of its weights there (rows, labels)
            per.scatter_add_(1, where, labels.weights.to(live.device, torch.float64).reshape(g.shape).abs())
            m = torch.where((per > 0) & live[:, None], 1.0 / per.clamp_min(torch.finfo(torch.float64).tiny),
                            torch.zeros_like(per))
        else:
            per.scatter_add_(1, where, torch.ones_like(g, dtype=torch.float64))
            m = ((per > 0) & live[:, None]).to(torch.float64)
        n = (m > 0).sum(dim=0)
        ok = ((n > 1) & (n < n_live)).tolist()
        label = (lambda v: f"the rows of {labels.of} {v}, each by 1/its weight") if weighted else (
            lambda v: f"the rows of {kind} {v}")
        names += [label(int(v)) for v, k in zip(values.tolist(), ok) if k]
        kinds += [kind] * sum(ok)
        cols.append(m[:, torch.tensor(ok, dtype=torch.bool, device=m.device)])
    return names, kinds, torch.cat(cols, dim=1)


def _measured_by_twin(acc: float | None) -> str:
    """What a rule 3 failure says of its accumulation term where the twin's measure set it."""
    if acc is None or not math.isfinite(acc):
        return ""
    alike = " (the two runs alike: all but zero)" if acc == 0 else ""
    return ", its accumulation as its twin run measured it" + alike


def _twin_log_delta(tests: int) -> float:
    """Rule 3's tail for a row's twin measure: its share of FALSE_VERDICT, squared (harness.judge.twin_floor)."""
    return 2.0 * math.log(FALSE_VERDICT / max(int(tests), 1))


def _twin_differences(out64: torch.Tensor, twin: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    diff = torch.where(written, out64 - twin.to(torch.float64), torch.zeros_like(out64))
    return torch.linalg.vector_norm(diff.reshape(diff.shape[0], -1), dim=1)


def _measured(kappa: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """kappa d, inf where the twin says nothing (no accumulation weights, or a non-finite twin: the other run's
    verdict fails that)."""
    acc = kappa * d
    return torch.where(torch.isfinite(d) & torch.isfinite(kappa), acc, torch.full_like(acc, math.inf))


def twin_terms(out64: torch.Tensor, twin: torch.Tensor, acc_var: torch.Tensor, written: torch.Tensor, tests: int,
               sources: int | None = None) -> torch.Tensor:
    """(T,) float64: each row's accumulation term for rule 3's floor as the twin run measures it, kappa ||out - twin||
    over the row's written elements (harness.judge.twin_floor: kappa at FALSE_VERDICT / tests, squared; a row counted
    as at most `sources` elements, its independent error sources: None, each element one; inf where the twin says
    nothing)."""
    from moe_lora_harness.harness.judge.twin_floor import at_most_sources, row_kappa
    log_delta = _twin_log_delta(tests)
    kappa = at_most_sources(row_kappa(acc_var, written, log_delta, TWIN_RHO), sources, log_delta, TWIN_RHO)
    return _measured(kappa, _twin_differences(out64, twin, written))


def rule3_base(emu: torch.Tensor, floor: torch.Tensor, acc: torch.Tensor,
               measured: torch.Tensor | None = None) -> torch.Tensor:
    """Rule 3's base (a row passes while its error is at most RATIO times it): max(emu, floor + acc), `floor` the
    terms besides the accumulation; with the twin's measure (`twin_terms`), acc at most `measured`, and the base at
    most max(emu, floor) + KAPPA_TAIL / RATIO measured as well: the twin's bound allows the measured accumulation
    KAPPA_TAIL kappa ||out - twin|| (its own event), where RATIO max(...) alone would grant it RATIO kappa ||out -
    twin||. docs/error-model.md, "Rule 3 with the twin"."""
    from moe_lora_harness.harness.judge.twin_floor import KAPPA_TAIL
    if measured is None:
        return torch.maximum(emu, floor + acc)
    base = torch.maximum(emu, floor + torch.minimum(acc, measured))
    seen = torch.isfinite(measured)
    m = torch.where(seen, measured, torch.zeros_like(measured))
    tight = torch.maximum(emu, floor) + (KAPPA_TAIL / RATIO) * m
    return torch.where(seen, torch.minimum(base, tight), base)


TWIN_ROWS_AT_ONCE = 32    # rows whose kappa is searched together while the worst row is sought


def _worst_row_with_twin(out64, twin, acc_var, written, tests: int, ratios,
                         sources: int | None = None) -> tuple[int, float, float]:
    """(row, ratio, its measured accumulation term) of rule 3's worst row under the twin's measure, as if every row's
    kappa were searched (`twin_terms`), searching few: each row's ratio under the least kappa a row of its
    element count can have (`twin_floor.kappa_lower_bound`) is at least its ratio; rows are refined in that bound's
    order until no bound left exceeds the worst ratio found. `ratios(idx, measured)`: rule 3 of rows idx."""
    from moe_lora_harness.harness.judge.twin_floor import at_most_sources, kappa_lower_bound
    d = _twin_differences(out64, twin, written)
    weighted = (torch.where(written, acc_var, torch.zeros_like(acc_var)) > 0).reshape(d.shape[0], -1).sum(dim=1)
    log_delta = _twin_log_delta(tests)
    least = at_most_sources(kappa_lower_bound(weighted, log_delta, TWIN_RHO), sources, log_delta, TWIN_RHO)
    upper = ratios(None, _measured(least, d))
    order = torch.argsort(upper, descending=True)
    best, row, acc = -1.0, int(order[0]), math.inf
    for start in range(0, order.numel(), TWIN_ROWS_AT_ONCE):
        idx = order[start:start + TWIN_ROWS_AT_ONCE]
        if float(upper[idx[0]]) <= best:
            break
        measured = twin_terms(out64[idx], twin[idx], acc_var[idx], written[idx], tests, sources)
        r = ratios(idx, measured)
        j = int(r.argmax())
        if float(r[j]) > best:
            best, row, acc = float(r[j]), int(idx[j]), float(measured[j])
    return row, best, acc


def row_ratios(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, scale: torch.Tensor,
               written: torch.Tensor, one_flip: torch.Tensor | None, *, dtype: torch.dtype, k_plus_r: int,
               underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
               slack_flip: torch.Tensor | None = None, acc_var: torch.Tensor | None = None,
               other_rows: torch.Tensor | None = None, twin_acc: torch.Tensor | None = None,
               tests: int | None = None) -> torch.Tensor:
    """(T,) float64: rule 3's ratio of each row (dim 0) over its written elements, against the row's own floor
    (one_flip[t] + slack_flip[t] its flip terms, None: none; acc_var its accumulation term, None: the worst case; at
    most the twin's measure of it, `twin_acc`: `twin_terms`, `rule3_base`), plus
    other_points_tail sqrt(other_rows[t]) / RATIO (`other_points_rows`: a kernel that may round at other points;
    None: none), that tail at `tests` comparisons (None: rule3_tests(truth); a caller judging some rows of an output
    passes the whole output's).
    Why per row: docs/error-model.md, "The aggregate rule per row". A row with nothing written has ratio 0."""
    for name, t in (("one_flip", one_flip), ("slack_flip", slack_flip)):
        if t is not None and (t.dim() != 1 or t.shape[0] != truth.shape[0]):
            raise ValueError(f"{name} must have shape ({truth.shape[0]},) (one value per row of the output), "
                             f"got {tuple(t.shape)}")
    dims = tuple(range(1, truth.dim()))

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.where(written, x, torch.zeros_like(x)), dim=dims)

    kern, emu = norm(out64 - truth), norm(emulation - truth)
    acc = (ACC_SIGMAS * norm(acc_var.clamp_min(0).sqrt()) if acc_var is not None
           else math.sqrt(max(k_plus_r, 1)) * EPS32 * norm(scale))
    floor = 0.5 * _eps(dtype) * norm(truth)
    if one_flip is not None:
        floor = floor + one_flip.to(torch.float64)
    if underflow is not None:
        floor = floor + 0.5 * tiny(work_dtype or dtype) * norm(underflow)
    if slack_flip is not None:
        floor = floor + slack_flip.to(torch.float64)
    base = rule3_base(emu, floor, acc, None if twin_acc is None else twin_acc.to(acc.device, torch.float64))
    if other_rows is not None:
        base = base + other_points_tail(rule3_tests(truth) if tests is None else tests) \
            * other_rows.to(torch.float64).sqrt() / RATIO
    ratio = kern / torch.where(base > 0, base, torch.ones_like(base))
    return torch.where(base > 0, ratio, torch.where(kern > 0, torch.full_like(kern, math.inf), torch.zeros_like(kern)))


def _unravel(flat: torch.Tensor, shape) -> torch.Tensor:
    """(n, ndim) indices of flat positions (torch.unravel_index imports sympy: seconds on first use)."""
    cols, rest = [], flat.clone()
    for size in reversed(tuple(shape)):
        cols.append(rest % size)
        rest = torch.div(rest, size, rounding_mode="floor")
    return torch.stack(cols[::-1], dim=1) if cols else flat.reshape(-1, 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit-for-bit equality of two tensors of one dtype (NaN payloads, the sign of zero)."""
    return a.contiguous().view(bits_dtype(a.dtype)) == b.contiguous().view(bits_dtype(b.dtype))


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included; -0.0 != +0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(same_bits(a.detach().cpu(), b.detach().cpu()).all())


def format_worst(verdict: Verdict, names=("t", "j", "col"), coords=None) -> str:
    """Table of the worst elements; `coords(index) -> str` adds e.g. expert and LoRA of the pair."""
    lines = [f"  {'(' + ', '.join(names) + ')':<22} {'kernel':>14} {'truth':>14} {'emulation':>14} {'bound':>10}  "]
    for idx, o, t, e, b in verdict.worst:
        extra = ("  " + coords(idx)) if coords else ""
        lines.append(f"  {str(idx):<22} {o:>14.7g} {t:>14.7g} {e:>14.7g} {b:>10.3g}{extra}")
    return "\n".join(lines)


def differing_tokens(out_view: torch.Tensor, out_plain: torch.Tensor, view: str) -> list[int]:
    """The view's token rows whose bits differ from the plain run's (NaN compared by its bits too)."""
    want = plain_rows(out_plain, view).to(out_view.device)
    if want.shape != out_view.shape:
        return list(range(out_view.shape[0]))
    return (~same_bits(out_view, want)).any(dim=1).nonzero().flatten().tolist()
