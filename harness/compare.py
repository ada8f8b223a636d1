"""The comparison: a kernel's output against the float64 truth, bounded by the rounding-aware emulation.

Error model (docs/error-model.md): over the elements the contract writes,
  1. nothing non-finite where the truth is finite (NaN/Inf never pass);
  2. per element  |out - truth| <= ULPS * eps_dt * scale + sqrt(K+R) * eps_fp32 * scale + tiny_dt * underflow
     + flip, where `scale` is the element's forward-error magnitude (|prev| + |w| |B| |A| |x| ...) in float64,
     `underflow` its exposure to gradual underflow (each rounding below dt's smallest normal may add half
     dt's smallest subnormal `tiny_dt`, times what later steps multiply it by: twice that is allowed) and
     `flip` (FP8 activations only) the absolute allowance for e4m3 roundings a correct kernel may take the
     other way, all at once;
  3. in aggregate ||out - truth|| <= RATIO * max(||emulation - truth||, floor),
     floor = 0.5 eps_dt ||truth|| + sqrt(K+R) eps_fp32 ||scale|| + 0.5 tiny_dt ||underflow|| + max(one_flip)
     + ||slack_flip||, `one_flip` (FP8 only) a row's output change from its costliest single flip (the emulation's
     own flips stand for a correct kernel's, except where it has next to none: a small case), `slack_flip` (FP8) a
     row's from the GEMM1 flips only a kernel's fp32 scale arithmetic takes; with FP8 activations (quantized per
     token) rule 3 holds for each token row too, against the row's own floor (`row_ratios`).
Elements the contract does not write are compared bit for bit with what the buffer held.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe_lora_harness.reference.precision import tiny   # the unit of rule 4's underflow exposure

ULPS = 4.0     # per element, in units of eps_dt at the element's forward-error scale
RATIO = 3.0    # aggregate: at most this many times farther from the truth than the emulation
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

    def summary(self) -> str:
        return f"{self.kind}: ratio={self.ratio:.3g} (<= {RATIO}), worst element at {self.max_ulps:.3g}x its bound"


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


def compare_written(out: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, scale: torch.Tensor,
                    written: torch.Tensor, *, dtype: torch.dtype, k_plus_r: int,
                    before: torch.Tensor | None = None, names=("t", "j", "col"),
                    underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
                    flip: torch.Tensor | None = None, one_flip: torch.Tensor | None = None,
                    slack_flip: torch.Tensor | None = None) -> Verdict:
    """Compare `out` (the kernel's buffer, any float dtype) with the float64 truth under the error model.

    `written` marks elements the contract writes; elsewhere `out` must equal `before` bit for bit
    (when `before` is given). `underflow` (the reference's exposure, None: no allowance) is in half
    subnormal spacings of `work_dtype`, the dtype the kernel rounds to (default `dtype`, the bound's).
    `flip` (T, H), `one_flip` and `slack_flip` (T,) (the reference's ExpertExpected fields, absolute; None: none)
    widen the per-element bound and the aggregate floor; with `one_flip` rule 3 holds for each row too (`row_ratios`).
    Computed where `truth` lies (a CUDA judge's device): the other tensors are moved there.
    """
    if tuple(out.shape) != tuple(truth.shape):
        return Verdict(False, "shape", f"output shape {tuple(out.shape)} != expected {tuple(truth.shape)}")
    dev = truth.device
    o = out.detach().to(dev)
    written = written.to(dev).bool()
    emulation, scale = emulation.to(dev), scale.to(dev)
    underflow = underflow.to(dev) if underflow is not None else None
    flip = flip.to(dev) if flip is not None else None
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
                       f"{int(nonfinite.sum())} written element(s) are NaN/Inf (unwritten or overflow); first at "
                       f"({', '.join(names)}): {ex}")
    eps_dt = _eps(dtype)
    acc = math.sqrt(max(k_plus_r, 1)) * EPS32
    bound = element_bound(scale, dtype=dtype, k_plus_r=k_plus_r, underflow=underflow, work_dtype=work_dtype, flip=flip)
    under_w = None
    if underflow is not None:
        t_dt = tiny(work_dtype or dtype)
        under_w = underflow[written]
    err = (o64 - truth).abs()
    rel = torch.where(written, err / bound, torch.zeros_like(err))
    max_ulps = float(rel.max())
    kern = float(torch.linalg.vector_norm(ow - tw))
    emu = float(torch.linalg.vector_norm(ew - tw))
    floor = 0.5 * eps_dt * float(torch.linalg.vector_norm(tw)) + acc * float(torch.linalg.vector_norm(sw))
    if under_w is not None:
        floor += 0.5 * t_dt * float(torch.linalg.vector_norm(under_w))
    if one_flip is not None and one_flip.numel():
        floor += float(one_flip.max())
    if slack_flip is not None:
        floor += float(torch.linalg.vector_norm(slack_flip.to(torch.float64)))
    base = max(emu, floor)
    ratio = kern / base if base > 0 else (0.0 if kern == 0 else math.inf)
    row, row_ratio = None, 0.0
    if one_flip is not None and one_flip.numel():
        rows = row_ratios(o64, truth, emulation, scale, written, one_flip.to(dev), dtype=dtype, k_plus_r=k_plus_r,
                          underflow=underflow, work_dtype=work_dtype,
                          slack_flip=slack_flip.to(dev) if slack_flip is not None else None)
        row = int(rows.argmax())
        row_ratio = float(rows[row])
    order = torch.topk(rel.flatten(), min(6, rel.numel())).indices   # the worst six, largest first
    idx = _unravel(order, rel.shape)
    worst = _fmt_worst(idx, o64, truth, emulation, bound, names)
    agg = max(ratio, row_ratio)      # the aggregate statistic: the whole tensor's, or its worst row's
    if max_ulps > 1.0:
        return Verdict(False, "element", f"{int((rel > 1).sum())} element(s) exceed the per-element bound "
                       f"(worst {max_ulps:.3g}x); aggregate ratio {agg:.3g}", agg, max_ulps, worst)
    if ratio > RATIO:
        return Verdict(False, "aggregate", f"aggregate error {kern:.3g} is {ratio:.3g}x the emulation's "
                       f"{emu:.3g} (floor {floor:.3g}); bound {RATIO}", agg, max_ulps, worst)
    if row_ratio > RATIO:
        return Verdict(False, "aggregate", f"row {names[0]}={row}'s aggregate error is {row_ratio:.3g}x the larger "
                       f"of its emulation's and its floor (FP8 activations: rule 3 per token row); bound {RATIO}; "
                       f"the whole tensor's ratio {ratio:.3g}", agg, max_ulps, worst)
    return Verdict(True, "pass", "", agg, max_ulps, worst)


def row_ratios(out64: torch.Tensor, truth: torch.Tensor, emulation: torch.Tensor, scale: torch.Tensor,
               written: torch.Tensor, one_flip: torch.Tensor, *, dtype: torch.dtype, k_plus_r: int,
               underflow: torch.Tensor | None = None, work_dtype: torch.dtype | None = None,
               slack_flip: torch.Tensor | None = None) -> torch.Tensor:
    """(T,) float64: rule 3's ratio of each row (dim 0) over its written elements, against the row's own floor
    (one_flip[t] + slack_flip[t] its flip terms). Why per row: docs/error-model.md, "The aggregate rule per row"."""
    for name, t in (("one_flip", one_flip), ("slack_flip", slack_flip)):
        if t is not None and (t.dim() != 1 or t.shape[0] != truth.shape[0]):
            raise ValueError(f"{name} must have shape ({truth.shape[0]},) (one value per row of the output), "
                             f"got {tuple(t.shape)}")
    dims = tuple(range(1, truth.dim()))

    def norm(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(torch.where(written, x, torch.zeros_like(x)), dim=dims)

    kern, emu = norm(out64 - truth), norm(emulation - truth)
    floor = (0.5 * _eps(dtype) * norm(truth) + math.sqrt(max(k_plus_r, 1)) * EPS32 * norm(scale)
             + one_flip.to(torch.float64))
    if underflow is not None:
        floor = floor + 0.5 * tiny(work_dtype or dtype) * norm(underflow)
    if slack_flip is not None:
        floor = floor + slack_flip.to(torch.float64)
    base = torch.maximum(emu, floor)
    ratio = kern / torch.where(base > 0, base, torch.ones_like(base))
    return torch.where(base > 0, ratio, torch.where(kern > 0, torch.full_like(kern, math.inf), torch.zeros_like(kern)))


def _unravel(flat: torch.Tensor, shape) -> torch.Tensor:
    """(n, ndim) indices of flat positions (torch.unravel_index imports sympy: seconds on first use)."""
    cols, rest = [], flat.clone()
    for size in reversed(tuple(shape)):
        cols.append(rest % size)
        rest = torch.div(rest, size, rounding_mode="floor")
    return torch.stack(cols[::-1], dim=1) if cols else flat.reshape(-1, 0)


def _int_view(t: torch.Tensor):
    return {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit-for-bit equality of two tensors of one dtype (NaN payloads, the sign of zero)."""
    return a.contiguous().view(_int_view(a)) == b.contiguous().view(_int_view(b))


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
