"""The MoE expert computation with LoRA, as TritonExperts.apply + LoRAExpertsMixin run it (spec 5).

`moe_experts_forward` computes, in float64 from the given (possibly low-precision) tensors, the base
w13 GEMM, the w13 LoRA delta, the activation, the weighted w2 GEMM, the w2 LoRA delta and moe_sum,
rounding where the production path rounds (per `Precision`), plus a first-order forward-error
magnitude (`scale`) that the comparison uses for its per-element ulp bound.
"""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from torch import Tensor

from moe_lora_harness.reference.accumulation import ACT_ULPS, U32, dot_variance, own_variance
from moe_lora_harness.reference.activations import (activation_derivatives, activation_flush, activation_remainder,
                                                    activation_scale, activation_variance, apply_activation,
                                                    lookup_activation)
from moe_lora_harness.reference.adapters import StackedMoELoRA
from moe_lora_harness.reference.fp8 import (A_BOUND_ULPS, check_scheme, fake_quantize_activation, flip_allowance,
                                            flip_chance, flip_step, quantize_activation)
from moe_lora_harness.reference.fp8_mma import KernelMMA, scaled_gemm
from moe_lora_harness.reference.lora_op import (PairLayout, lora_expand, lora_shrink, qualifying_pairs,
                                                shrink_magnitudes)
from moe_lora_harness.reference.precision import Precision, eps, precision as make_precision, spacing_sq, tiny
from moe_lora_harness.reference.quant import ACTIVATION_SCHEMES, SCHEMES as WEIGHT_ONLY_SCHEMES
from moe_lora_harness.reference.semantics import CONTRACT, Semantics

__all__ = ["LoRAInputs", "LoRACollectives", "ExpertExpected", "forward_steps", "moe_experts_forward"]

_F64 = torch.float64
_EXACT = make_precision("exact", None)


@dataclass
class LoRAInputs:
    """The LoRA side of one forward: stacked buffers, the per-token slot (-1 = no adapter).

    `lora_ids`, when given, restricts the LoRA to the slots listed there (the sorted-mode kernels
    only visit `lora_ids[:num_active]`, -1 entries ignored); None = every slot a token maps to.
    """

    stacked: StackedMoELoRA
    token_lora_mapping: Tensor  # (T,) int
    lora_ids: Tensor | None = None


@dataclass
class LoRACollectives:
    """Fully-sharded joins between LoRA shrink and expand: w13 all-gather (rank dim), w2 all-reduce.

    Each callable joins float64 (S', P, R_local) partials into the (S', P, R) tensor every rank gets:
    `moe_experts_forward` calls it with this rank's partial (the callable reaches the other ranks);
    reference.sharding's simulated ranks, run in lockstep, with every rank's, in rank order
    (all_gather_last, all_reduce_sum). S' stacks several caches (value and error magnitude), so it must
    act along the last dim (gather) or elementwise (sum). Rounding of the joined value is applied by the
    caller. None: no join.
    """

    w13: Callable[[Tensor], Tensor] | None = None
    w2: Callable[[Tensor], Tensor] | None = None


@dataclass
class ExpertExpected:
    """Expected expert output: value (T, H) and error magnitude scale (T, H), both float64 (scale and
    underflow None with magnitudes=False: an emulation, judged against the truth's magnitudes).

    With return_intermediates, cache1 (T, k, N1), cache2 (T, k, I) and cache3 (T, k, H) as the
    reference holds them (float64; rows of non-local pairs are 0).
    """

    value: Tensor
    scale: Tensor | None
    # (T, H): exposure to gradual underflow in half subnormal spacings (reference.lora_op.OpExpected.underflow)
    underflow: Tensor | None = None
    # (T, H): the variance bound of the error a correct kernel's fp32 accumulation adds (reference.accumulation);
    # None with FP8 activations (the e4m3 MMA's accumulation is not modelled statistically: the worst-case term)
    acc_var: Tensor | None = None
    # (T, H): the exposure to intermediate roundings a correct kernel may take the other way, in units of the working
    # dtype's eps^2 (reference.lora_op.OpExpected.round_var); None where acc_var is
    round_var: Tensor | None = None
    # FP8 schemes (None otherwise), absolute: the allowance for e4m3 roundings of the quantized activations that a
    # correct kernel may take the other way ("flips"). `flip` (T, H): every such flip at once, the per-element
    # bound's term; `one_flip` (T,): the norm of the token's output change from its costliest single flip of
    # GEMM2's input, the aggregate floor's term; `slack_flip` (T,): the most the token's output row may move (norm)
    # when GEMM1 input elements within the fp32 slack of scale arithmetic of an e4m3 rounding boundary (exact ties,
    # common with 16-bit inputs) flip, which a kernel may do and the emulation (the truth's arithmetic) never does,
    # the aggregate floor's other term. docs/error-model.md, "FP8 activations"
    flip: Tensor | None = None
    one_flip: Tensor | None = None
    slack_flip: Tensor | None = None
    # FP8 schemes (None otherwise): (T, H, 2) each output element's expected square of its change from GEMM2's input
    # flips, each flip's probability bounded by Chebyshev's inequality from the kernel's deviation there (rule 4's
    # flip allowance): column 0 for a kernel that rounds where its model does, 1 for one that may round once more at
    # every point. docs/error-model.md, "FP8 rows in rule 4"
    flip_sq: Tensor | None = None
    cache1: Tensor | None = None
    cache2: Tensor | None = None
    cache3: Tensor | None = None


def _f64(name: str, t: Tensor | None, shape: tuple[int, ...] | None, *, convert: bool = True) -> Tensor | None:
    """Float tensor -> float64, checking the shape; ValueError/TypeError names the argument. `convert=False`: the
    checks only (a layer's weights are converted one expert at a time: `_per_expert_gemm`)."""
    if t is None:
        return None
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor"
                        + (f" of shape {shape}" if shape else "") + f", got {getattr(t, 'dtype', type(t).__name__)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t.to(_F64) if convert else t


def _check_devices(device: torch.device, **tensors) -> None:
    """Every given tensor on `device` (hidden's): a ValueError names the first that is elsewhere."""
    for name, t in tensors.items():
        if isinstance(t, Tensor) and t.device != device:
            raise ValueError(f"{name} must be on hidden's device {device}, got {t.device}")


def _int(name: str, t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Integer tensor of the given shape -> int64."""
    if not isinstance(t, Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer torch.Tensor of shape {shape}, "
                        f"got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    return t.to(torch.int64)


def _per_expert_gemms(jobs: dict, w: Tensor, experts: Tensor, prec: Precision | None = None) -> dict:
    """{name: (x (P, K) float64, how)} -> {name: row p = x[p] @ f(w[experts[p]])^T} (0 where experts[p] < 0), in
    one pass over the experts. w (E, N, K) of any float dtype; how None: the value (`prec` with an alternative GEMM
    model computes the products by `prec.mm`; None: exact float64), "abs": |w| (a magnitude), "square": w*w (a
    variance carried through).

    Only the weights of the expert in hand are converted to float64, once for every job (a layer of many large
    experts never exists in float64 at once, and each expert's weights are read once per GEMM, not once per
    magnitude). Each expert's rows, in ascending order, are found by one stable sort (one host sync for the counts,
    not one per expert). A coarse-accumulation model's GEMMs run for every expert at once
    (`_batched_accumulation`)."""
    out = {name: torch.zeros(x.shape[0], w.shape[1], dtype=_F64, device=x.device) for name, (x, _) in jobs.items()}
    groups = _rows_by_expert(experts, w.shape[0])
    if prec is not None and prec.accumulate is not None:   # the jobs _batched_accumulation cannot take stay looped
        jobs = {name: (x, how) for name, (x, how) in jobs.items()
                if how is not None or not _batched_accumulation(out[name], x, w, groups, prec)}
        if not jobs:
            return out
    hows = {how for _, how in jobs.values()}
    for e, rows in groups:
        # a fresh copy, float64 weights too: a CPU BLAS sums an unaligned view (w[e] of an odd-sized layer) in
        # another order, last bits that a float64 layer handed over would otherwise not share with a converted one
        we = w[e].to(_F64, copy=True)
        forms = {None: we}
        if "abs" in hows:
            forms["abs"] = we.abs()
        if "square" in hows:
            forms["square"] = we * we
        for name, (x, how) in jobs.items():
            xe = x[rows]
            plain = how is not None or prec is None or prec.plain_gemm
            out[name][rows] = xe @ forms[how].T if plain else prec.mm(xe, we)
        del we, forms
    return out


def _mma_gemm(x: Tensor, scheme: str, weights: tuple, experts: Tensor, rows: Tensor | None,
              tile: int | None) -> Tensor:
    """An FP8 base GEMM on the e4m3 MMA (reference.fp8_mma.scaled_gemm): `x` (rows, K) quantized dynamically by
    `scheme`, row p of the result reading x[rows[p]] (rows None: x[p]) and expert experts[p]'s codes and scales
    (`weights`); 0 where experts[p] < 0."""
    q, s = quantize_activation(x, scheme)
    _, width = check_scheme(scheme)                       # the activation's scale group along K (None: the row)
    group = s[:, :1] if width is None else s[:, ::width]
    if rows is not None:
        q, group = q[rows], group[rows]
    codes, scales = weights
    out = torch.zeros(q.shape[0], codes.shape[1], dtype=_F64, device=q.device)
    for e, idx in _rows_by_expert(experts, codes.shape[0]):
        out[idx] = scaled_gemm(q[idx], group[idx], codes[e].to(_F64), scales[e].to(_F64), scheme, tile)
    return out


def _rows_by_expert(experts: Tensor, num_experts: int) -> list:
    """[(e, the rows routed to expert e, ascending)] for every expert with rows (rows of -1, not local, left out):
    one stable sort and one host sync for the counts."""
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts + 1, minlength=num_experts + 1).tolist()   # [rows of -1, of 0, ...]
    groups, start = [], counts[0]
    for e, c in enumerate(counts[1:]):
        if c:
            groups.append((e, order[start:start + c]))
        start += c
    return groups


BATCHED_ACCUMULATION_BYTES = 1 << 30   # the padded float64 operands and sums one K loop over every expert may hold


def _batched_accumulation(out: Tensor, x: Tensor, w: Tensor, groups: list, prec: Precision) -> bool:
    """`_per_expert_gemms` of a coarse-accumulation model (one rounded partial sum per K step: K host-side steps
    per GEMM) for every expert of `groups` (_rows_by_expert) in one K loop, the experts' rows padded to the busiest
    one's count; False (nothing written) where the padded float64 tensors would pass BATCHED_ACCUMULATION_BYTES.
    The same bits as a loop over the experts: every step is elementwise."""
    if not groups:
        return True
    most, (n, k) = max(len(rows) for _, rows in groups), w.shape[1:]
    if len(groups) * (most * (k + 2 * n) + n * k) * 8 > BATCHED_ACCUMULATION_BYTES:
        return False
    xs = torch.zeros(len(groups), most, k, dtype=_F64, device=x.device)
    for i, (_, rows) in enumerate(groups):
        xs[i, :len(rows)] = x[rows]
    got = prec.mm(xs, torch.stack([w[e].to(_F64) for e, _ in groups]))
    for i, (_, rows) in enumerate(groups):
        out[rows] = got[i, :len(rows)]
    return True


def _per_expert_gemm(x: Tensor, w: Tensor, experts: Tensor, prec: Precision | None = None, *,
                     absolute: bool = False, square: bool = False) -> Tensor:
    """One job of `_per_expert_gemms`: x[p] @ w[experts[p]]^T (|w| with `absolute`, w*w with `square`)."""
    how = "abs" if absolute else "square" if square else None
    return _per_expert_gemms({"y": (x, how)}, w, experts, prec)["y"]


def _column_norms(w: Tensor) -> Tensor:
    """(E, K) float64: the 2-norm of each column of each expert's weight w[e] (N, K), one expert at a time."""
    return torch.stack([torch.linalg.vector_norm(w[e].to(_F64), dim=0) for e in range(w.shape[0])])


def _per_expert_rows(b: Tensor, experts: Tensor) -> Tensor:
    """Row p: b[experts[p]] (0 where experts[p] < 0). b (E, N) float64."""
    out = torch.zeros(experts.shape[0], b.shape[1], dtype=_F64, device=b.device)
    m = experts >= 0
    out[m] = b[experts[m]]
    return out


def _check_lora(stacked: StackedMoELoRA, E: int, H: int, I: int, gated: bool, sharded: bool) -> None:
    """Shapes of the stacked LoRA against the base layer (local experts E, hidden H, intermediate I)."""
    if not isinstance(stacked, StackedMoELoRA):
        raise TypeError(f"lora.stacked must be a StackedMoELoRA, got {type(stacked).__name__}")
    S = 2 if gated else 1
    if stacked.num_slices != S or len(stacked.w13_b) != S:
        raise ValueError(f"lora.stacked must have {S} w13 slice(s) for a {'gated' if gated else 'non-gated'} "
                         f"activation, got {stacked.num_slices} A / {len(stacked.w13_b)} B")
    if len(stacked.w2_a) != 1 or len(stacked.w2_b) != 1:
        raise ValueError("lora.stacked.w2_a and w2_b must each hold exactly one slice")
    L = stacked.max_loras
    R = int(stacked.w2_a[0].shape[2])
    for s in range(S):
        a, b = stacked.w13_a[s], stacked.w13_b[s]
        if a.dim() != 4 or a.shape[0] != L or a.shape[1] not in (1, E) or a.shape[3] != H:
            raise ValueError(f"lora.stacked.w13_a[{s}] must be (L={L}, E={E} or 1, R, H={H}), got {tuple(a.shape)}")
        if tuple(b.shape) != (L, E, I, R):
            raise ValueError(f"lora.stacked.w13_b[{s}] must be (L={L}, E={E}, I={I}, R={R}), got {tuple(b.shape)}")
        if not sharded and a.shape[2] != R:
            raise ValueError(f"lora.stacked.w13_a[{s}] has rank {a.shape[2]} but w13_b has {R} "
                             "(a rank-sharded A needs lora_collectives)")
    a2, b2 = stacked.w2_a[0], stacked.w2_b[0]
    if tuple(a2.shape) != (L, E, R, I):
        raise ValueError(f"lora.stacked.w2_a[0] must be (L={L}, E={E}, R={R}, I={I}), got {tuple(a2.shape)}")
    if b2.dim() != 4 or b2.shape[0] != L or b2.shape[1] not in (1, E) or b2.shape[3] != R or b2.shape[2] > H:
        raise ValueError(f"lora.stacked.w2_b[0] must be (L={L}, E={E} or 1, H={H} or a shard, R={R}), "
                         f"got {tuple(b2.shape)}")
    if not sharded and b2.shape[2] != H:
        raise ValueError(f"lora.stacked.w2_b[0] has {b2.shape[2]} rows but H={H} "
                         "(an H-sharded B needs lora_collectives)")
    ae = stacked.adapter_enabled
    if not isinstance(ae, Tensor) or tuple(ae.shape) != (L + 1,):
        raise ValueError(f"lora.stacked.adapter_enabled must have shape (L+1={L + 1},)")


def _shrink_joined(x, stacked_a, x_scale, x_under, layout, k, mul_routed_weight, prec, join, x_var=None,
                   track_var=False, x_round=None):
    """Shrink u = A x (rounded per `prec`), its magnitude |A| x_scale, its underflow exposure |A| x_under + 1 and
    (`track_var`) its fp32 accumulation variance (x_var None: an exact input) and rounding exposure (x_round: x's,
    None: an exact input; the partial's own rounding included), joined across the TP ranks when
    `join` names the collective ("w13" or "w2"; None: no join; x_scale None: the value only, magnitudes None).
    A generator: it yields (join, the partial) and resumes with the joined tensor.

    The parts travel through one collective call (stacked on the slice dim); the joined value is
    re-rounded when the path rounds the intermediate (a reduced dt cache is a dt tensor). Variances travel (a
    gather) or add (an all-reduce), as the collective does with every part.
    """
    u = lora_shrink(x, stacked_a, layout, k, mul_routed_weight, prec)
    parts = [u]
    if x_scale is not None:     # every magnitude in one pass over the (slot, expert) weights
        mags = shrink_magnitudes(x, x_scale, x_under, x_var, x_round, stacked_a, layout, k, mul_routed_weight, u,
                                 track_var=track_var)
        parts += [mags["scale"], mags["under"]] + ([mags["var"], mags["round"]] if track_var else [])
    if join is not None:
        joined = yield join, torch.cat([p.to(_F64) for p in parts], dim=0)
        parts = list(joined.split(u.shape[0], dim=0))
        if prec.round_rank_intermediate:
            parts[0] = prec.r(parts[0])
        if x_scale is not None:
            parts[2] = parts[2] + 1.0       # the join's own rounding
        if len(parts) > 3:
            parts[3] = parts[3] + own_variance(parts[0])   # the join's own fp32 add
    u_abs, u_under = parts[1:3] if x_scale is not None else (None, None)
    u_var, u_round = (parts[3], parts[4]) if len(parts) > 3 else (None, None)
    return parts[0], u_abs, u_under, u_var, u_round


def _lora_delta(x, stacked_a, stacked_b, x_scale, x_under, prev, prev_under, w32, layout, k, mul_routed_weight,
                offset, prec, join, add_inputs=True, x_var=None, prev_var=None, track_var=False, x_round=None,
                prev_round=None):
    """(value, magnitude, underflow exposure, accumulation variance) of one LoRA GEMM written into `prev`
    (T, k, W), float64.

    value: lora_expand's r(prev + r?(w B u)) (or r(w B u) without add_inputs); magnitude:
    |w| |B| (|A| x_scale) at written elements, 0 elsewhere, computed exactly on absolute values;
    underflow: lora_expand's, from `prev_under` and the intermediate's; variance and rounding exposure (`track_var`,
    else None): lora_expand's, from `prev_var` / `prev_round` and x's `x_var` / `x_round` (None: exact), the
    write's own rounding added. x_scale None: the value only. A generator, as `_shrink_joined` (`join`).
    """
    u, u_abs, u_under, u_var, u_round = yield from _shrink_joined(x, stacked_a, x_scale, x_under, layout, k,
                                                                  mul_routed_weight, prec, join, x_var, track_var,
                                                                  x_round)
    if u_round is not None:      # lora_expand counts the intermediate's own rounding itself
        u_round = u_round - spacing_sq(u)
    got = lora_expand(prev, u, stacked_b, w32, layout, k, mul_routed_weight, offset, add_inputs, prec,
                      cache_underflow=u_under, prev_underflow=prev_under, cache_var=u_var, prev_var=prev_var,
                      cache_round=u_round, prev_round=prev_round, magnitudes=x_scale is not None)
    if x_scale is None:
        return got.value, None, None, None, None
    mag = _abs_expand(u_abs, stacked_b, w32, prev, layout, k, mul_routed_weight, offset)
    if not track_var:
        return got.value, mag, got.underflow, None, None
    written = got.written
    rounded = torch.where(written, got.round_var + spacing_sq(got.value), got.round_var)   # the write's rounding
    return got.value, mag, got.underflow, got.acc_var, rounded


def _abs_expand(u_abs, stacked_b, w32, like, layout, k, mul_routed_weight, offset):
    """|w| |B| u_abs at the elements a LoRA expand writes (0 elsewhere), shaped as `like` (T, k, W), float64: how
    an absolute error (or magnitude) `u_abs` of the rank intermediate reaches the output."""
    return lora_expand(torch.zeros_like(like), u_abs, [b.abs() for b in stacked_b], w32.abs(), layout, k,
                       mul_routed_weight, offset, False, _EXACT).value


def _activation_change(c: Tensor, e: Tensor, spec) -> Tensor:
    """(P, I) float64: the largest |h(c') - h(c)| of the activation h over the corners c' = c +- e (each input of an
    output element moved by its e, either way). Where e is large beside a kink (a clamp: swigluoai's 7), the first-
    order |h'| e misses the jump across it; the corners see it. GEMM1's FP8 flips are e4m3 steps: a few % of c."""
    h = apply_activation(c, spec.name)
    n1 = c.shape[-1]
    worst = torch.zeros_like(h)
    for sg, su in ((1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)) if spec.gated else ((1.0, 1.0), (-1.0, -1.0)):
        if not spec.gated:
            sign = torch.full((n1,), sg, dtype=_F64, device=c.device)
        elif spec.interleaved:
            sign = torch.tensor([sg, su], dtype=_F64, device=c.device).repeat(n1 // 2)
        else:
            sign = torch.tensor([sg, su], dtype=_F64, device=c.device).repeat_interleave(n1 // 2)
        worst = torch.maximum(worst, (apply_activation(c + sign * e, spec.name) - h).abs())
    return worst


def _flip_squares(a: Tensor, err: Tensor, var: Tensor, rnd: Tensor, det: Tensor, step: Tensor, W2: Tensor,
                  e_flat: Tensor, scheme: str, dt: torch.dtype, w_pair: Tensor | None) -> Tensor:
    """(P, H, 2): each pair's expected square of each output element's change from flips of GEMM2's quantized input
    `a` (P, I): sum_j chance_j step_j^2 w2[e][h, j]^2, `step` (P, I) one flip's size (one e4m3 step x s: the floor's
    one flip), times w^2 with `w_pair` (the weight on the output); over a row, sum_j chance_j (step_j
    ||w2[e][:, j]||)^2. A kernel's activation lies off the truth's by its fp32 accumulation (`var`), its roundings
    (`rnd`, in eps_dt^2: variance eps_dt^2 rnd / 12 once (dt: the working dtype), twice for a kernel that may round
    once more at every point: the two columns) and at most `det` more (GEMM1's flips, underflow); `fp8.flip_chance`
    bounds each flip's probability from that. Per element, so that rule 4 can sum them over any block of columns.
    docs/error-model.md, "FP8 rows in rule 4"."""
    rounding = eps(dt) ** 2 / 12.0 * rnd.clamp_min(0)
    dev_sqs = [((var.clamp_min(0) + times * rounding).sqrt() + det) ** 2 for times in (1.0, 2.0)]
    step_sq = step * step
    jobs = {i: (chance * step_sq, "square") for i, chance in enumerate(flip_chance(a, err, dev_sqs, scheme))}
    got = _per_expert_gemms(jobs, W2, e_flat)
    out = torch.stack([got.pop(0), got.pop(1)], dim=2)
    return out if w_pair is None else out * (w_pair.reshape(-1, 1, 1) ** 2)


GRAM_BLOCK = 64     # rows of a Gram block in _slack_flips (whole pairs; a pair's rows only meet its own)


def _slack_flips(step: Tensor, cache1: Tensor, W13: Tensor, W2: Tensor, e_flat: Tensor, k: int, spec,
                 w_base: Tensor, w2_lora=None, rows_per_chunk: int = 1024) -> Tensor:
    """The GEMM1 flips a kernel's fp32 scale arithmetic may take: (P,) a bound on the norm of the pair's output
    change for any subset of its flippable input elements j, each flipped either way. Flip j alone changes the row by
    D_j = w_base w2[e] (h(c + d_j) - h(c)) plus, where the pair has a w2 LoRA, w_lora B (A (h(c + d_j) - h(c))) (the
    LoRA reads the unquantized activation, so a flip reaches it too), d_j = +-(one e4m3 step x s) x column j of w13[e],
    each computed exactly; flips combine linearly, so ||sum_{j in S} D_j^{s_j}||^2 <= sum_{j,l} max over the signs
    |<D_j^s, D_l^s'>| (the Gram bound: nearly orthogonal changes add in quadrature, where a sum of norms took them all
    in line). c: the pair's activation input (cache1, exact); step (T, H): `flip_step` of GEMM1's input with no error
    of its own; w_base (P,): the base GEMM2's factor (|w|, or 1 with the weight on the input); `w2_lora`: (slot (P,)
    -1 for none, A (L, E, R, I), B (L, E or 1, H', R), column offset, w_lora (P,)) or None. Few elements are
    flippable (exact ties, values within FP32_SLACK of a boundary): the work is per flippable element, a chunk of at
    most about `rows_per_chunk` of them at a time (whole pairs: a pair's Gram is never split)."""
    P = cache1.shape[0]
    square = torch.zeros(P, dtype=_F64, device=cache1.device)
    tj = step.nonzero()                                              # (n, 2): token, input element (token-major)
    pairs = (tj[:, :1] * k + torch.arange(k, device=tj.device)).T.reshape(-1)   # slot-major: a pair's rows adjacent
    cols, d = tj[:, 1].repeat(k), step[tj[:, 0], tj[:, 1]].repeat(k)
    experts = e_flat[pairs]
    for e in torch.unique(experts[experts >= 0]).tolist():
        sel = (experts == e).nonzero().flatten()
        sel = sel[torch.argsort(pairs[sel], stable=True)]          # each pair's rows together
        w13e, w2e = W13[e].to(_F64), W2[e].to(_F64)
        p_all = pairs[sel]
        bounds = torch.ones_like(p_all, dtype=torch.bool)
        bounds[1:] = p_all[1:] != p_all[:-1]                       # where a pair's rows start
        starts = bounds.nonzero().flatten().tolist() + [sel.numel()]

        def whole_pairs(at: int, most: int) -> int:   # the first pair start at or past at + most (or the end)
            return starts[min(bisect.bisect_left(starts, at + most), len(starts) - 1)]
        lo = 0
        while lo < sel.numel():
            hi = whole_pairs(lo, rows_per_chunk)
            part = sel[lo:hi]
            p = pairs[part]
            c = cache1[p]
            shift = d[part, None] * w13e[:, cols[part]].T                # (n, N1)
            h0 = apply_activation(c, spec.name)
            dh = torch.stack([apply_activation(c + shift, spec.name) - h0, apply_activation(c - shift, spec.name) - h0])
            change = (dh @ w2e.T) * w_base[p][None, :, None]              # (2, n, H)
            if w2_lora is not None:
                slot, a2, b2, offset, w_lora = w2_lora
                for l in torch.unique(slot[p]).tolist():
                    if l < 0:
                        continue
                    rows = (slot[p] == l).nonzero().flatten()
                    a = a2[l, e].to(_F64)                                   # (R, I)
                    b = b2[l, 0 if b2.shape[1] == 1 else e].to(_F64)        # (H', R)
                    delta = ((dh[:, rows] @ a.T) @ b.T) * w_lora[p[rows]][None, :, None]
                    change[:, rows, offset:offset + b.shape[0]] += delta
            b0 = lo
            while b0 < hi:     # the Gram in blocks of whole pairs (a pair's rows only meet its own)
                b1 = min(whole_pairs(b0, GRAM_BLOCK), hi)
                blk, pb = change[:, b0 - lo:b1 - lo], p[b0 - lo:b1 - lo]
                gram = (blk[0] @ blk[0].T).abs()
                for s_, t_ in ((0, 1), (1, 0), (1, 1)):
                    gram = torch.maximum(gram, (blk[s_] @ blk[t_].T).abs())
                square.index_add_(0, pb, (gram * (pb[:, None] == pb[None, :])).sum(dim=1))
                b0 = b1
            lo = hi
        del w13e, w2e
    return square.sqrt()


def _value_bound(scale: Tensor, under: Tensor, dt: torch.dtype, k_plus_r: int) -> Tensor:
    """Rule 2's worst-case bound on a value the reference carries, from its magnitudes: (A_BOUND_ULPS eps_dt +
    sqrt(K + R) eps_fp32) scale + tiny_dt under (harness.judge.compare.element_bound's, which a test keeps equal)."""
    return (A_BOUND_ULPS * eps(dt) + math.sqrt(k_plus_r) * eps(torch.float32)) * scale + tiny(dt) * under


def _interleave(split: Tensor, I: int) -> Tensor:
    """Split layout [g(I); u(I)] -> interleaved [g0, u0, g1, u1, ...] along the last dim."""
    out = torch.empty_like(split)
    out[..., 0::2] = split[..., :I]
    out[..., 1::2] = split[..., I:]
    return out


def forward_steps(
    hidden: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    activation: str,
    precision: Precision,
    w13_bias: Tensor | None = None,
    w2_bias: Tensor | None = None,
    lora: LoRAInputs | None = None,
    expert_map: Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    lora_collectives: LoRACollectives | None = None,
    w2_lora_offset: int = 0,
    return_intermediates: bool = False,
    magnitudes: bool = True,
    semantics: Semantics = CONTRACT,
    act_quant: str = "none",
    fp8_mma: KernelMMA | None = None,
) -> Generator[tuple[str, Tensor], Tensor, ExpertExpected]:
    """Expected MoE expert output (T, H) with LoRA, rounded where vLLM's Triton path rounds (spec 5).

    hidden (T, H); w13 (E, N1, H) with N1 = 2I gated / I; w2 (E, H, I); topk_weights (T, k)
    (promoted to fp32); topk_ids (T, k) GLOBAL ids, mapped by `expert_map` (E_global,) to local ids,
    non-local pairs contributing nothing. `precision.r` rounds to its dtype (identity when exact).
    apply_router_weight_on_input (top_k 1): base input r(x * r(w)) (vLLM casts w to the
    activation dtype first), w2 GEMM unweighted; the LoRA still reads the unweighted x and still
    weights the w2 delta. `lora_collectives`/`w2_lora_offset` serve fully-sharded TP ranks.
    magnitudes=False computes the value only (an emulation: the judge reads the truth's magnitudes).
    `semantics` other than the contract computes a named integration mistake (reference.semantics).
    `act_quant` an FP8 scheme (reference.fp8): both base GEMMs read the dynamically quantized activation (the
    hidden states, the activation's output), the LoRA deltas the unquantized ones (semantics 9.1); the truth's
    `flip` and `one_flip` carry the allowance for e4m3 flips (error model, "FP8 activations"). "none" and the
    weight-only schemes quantize no activation, so a caller may pass the case's scheme as it is. `fp8_mma` (an
    emulation of FP8 activations, magnitudes=False): both base GEMMs as that kernel runs them on an sm_90 e4m3 MMA
    (reference.fp8_mma.scaled_gemm) instead of exact sums of the e4m3 products.

    A generator: at each fully-sharded LoRA join that `lora_collectives` sets (w13 all-gather, w2 all-reduce)
    it yields (which, this rank's partial) and resumes with the joined tensor; it returns the ExpertExpected.
    `moe_experts_forward` answers each join with the rank's own callable; reference.sharding runs every
    simulated rank to the join, then joins (one thread).
    """
    if not isinstance(precision, Precision):
        raise TypeError(f"precision must be a reference.precision.Precision, got {type(precision).__name__}")
    if not isinstance(semantics, Semantics):
        raise TypeError(f"semantics must be a reference.semantics.Semantics, got {type(semantics).__name__}")
    spec = lookup_activation(activation)
    prec = precision
    if not isinstance(hidden, Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a 2-D tensor (T, H), got {getattr(hidden, 'shape', type(hidden).__name__)}")
    T, H = (int(s) for s in hidden.shape)
    if not isinstance(w13, Tensor) or w13.dim() != 3 or not isinstance(w2, Tensor) or w2.dim() != 3:
        raise ValueError("w13 must be (E, N1, H) and w2 (E, H, I)")
    E, N1 = int(w13.shape[0]), int(w13.shape[1])
    I = int(w2.shape[2])
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 must have shape (E={E}, H={H}, I), got {tuple(w2.shape)}")
    if tuple(w13.shape) != (E, N1, H) or N1 != (2 * I if spec.gated else I):
        raise ValueError(f"w13 must have shape (E={E}, N1={2 * I if spec.gated else I}, H={H}) for activation "
                         f"{spec.name!r} with I={I}, got {tuple(w13.shape)}")
    if not isinstance(topk_ids, Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be (T={T}, k), got {getattr(topk_ids, 'shape', None)}")
    k = int(topk_ids.shape[1])
    if k < 1:
        raise ValueError("topk_ids must have at least one column (top_k >= 1)")
    _check_devices(hidden.device, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, w13_bias=w13_bias,
                   w2_bias=w2_bias, expert_map=expert_map)
    x = _f64("hidden", hidden, (T, H))
    W13 = _f64("w13", w13, (E, N1, H), convert=False)     # converted one expert at a time
    W2 = _f64("w2", w2, (E, H, I), convert=False)
    b13 = _f64("w13_bias", w13_bias, (E, N1))
    b2 = _f64("w2_bias", w2_bias, (E, H))
    if (not isinstance(topk_weights, Tensor) or not topk_weights.is_floating_point()
            or tuple(topk_weights.shape) != (T, k)):
        raise ValueError(f"topk_weights must be a floating tensor of shape (T={T}, k={k}), got "
                         f"{getattr(topk_weights, 'dtype', None)} {tuple(getattr(topk_weights, 'shape', ()))}")
    w32 = topk_weights.to(torch.float32)
    w64 = w32.to(_F64)
    ids = _int("topk_ids", topk_ids, (T, k))
    E_global = E
    if expert_map is not None:
        E_global = int(expert_map.numel())
        emap = _int("expert_map", expert_map, (E_global,))
        if bool(((emap < -1) | (emap >= E)).any()):
            raise ValueError(f"expert_map values must be local ids in [0, E={E}) or -1")
    if bool(((ids < 0) | (ids >= E_global)).any()):
        raise ValueError(f"topk_ids must hold expert ids in [0, {E_global}) "
                         f"({'expert_map.numel()' if expert_map is not None else 'E'})")
    local = emap[ids] if expert_map is not None else ids  # (T, k), -1 = not on this rank
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1 (vLLM asserts it), got k={k}")
    if not isinstance(w2_lora_offset, int) or w2_lora_offset < 0:
        raise ValueError(f"w2_lora_offset must be an int >= 0, got {w2_lora_offset!r}")
    if act_quant != "none" and act_quant not in WEIGHT_ONLY_SCHEMES and act_quant not in ACTIVATION_SCHEMES:
        raise ValueError(f"act_quant must be 'none', a weight-only scheme {sorted(WEIGHT_ONLY_SCHEMES)} or an FP8 "
                         f"scheme {list(ACTIVATION_SCHEMES)}; got {act_quant!r}")
    fp8 = act_quant if act_quant in ACTIVATION_SCHEMES else None
    if fp8 is not None and hidden.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"act_quant={fp8!r} needs hidden in float16 or bfloat16 (vLLM's FP8 MoE quantizes 16-bit "
                         f"activations); got {hidden.dtype}")
    if fp8 is not None and lora_collectives is not None:
        raise ValueError(f"act_quant={fp8!r} with lora_collectives (fully-sharded TP ranks) is not modelled: a rank "
                         f"would quantize its own slice of the activation")
    if fp8_mma is not None and (fp8 is None or magnitudes or not isinstance(fp8_mma, KernelMMA)):
        raise ValueError(f"fp8_mma (a reference.fp8_mma.KernelMMA) is for the emulation (magnitudes=False) of FP8 "
                         f"activations; got {type(fp8_mma).__name__} with act_quant={act_quant!r}, "
                         f"magnitudes={magnitudes}")

    P = T * k
    e_flat = local.reshape(P)
    dev = x.device
    tok = torch.arange(P, device=dev) // k
    w_pair = w64.reshape(P, 1)

    # underflow exposure (`under*`): every rounding point adds 1, linear steps carry it by absolute values
    # base GEMM1: cache1 = r(x_in @ w13[e]^T + b1)
    x_in = prec.r(x * prec.r(w64)) if apply_router_weight_on_input else x  # k == 1 here: w64 is (T, 1)
    # FP8: the base GEMM reads the quantized input (per token / per group of 128, dynamic), the LoRA below x
    xr = (fake_quantize_activation(x_in, fp8) if fp8 is not None else x_in)[tok]
    mma1 = None if fp8_mma is None else _mma_gemm(x_in, fp8, fp8_mma.w13, e_flat, tok, fp8_mma.tile)
    scale1 = under1 = flip1 = slack_step = var1 = rnd1 = None
    # FP8 too: the fp32 accumulation of the exact e4m3 products and the scale multiplies (IEEE on a CPU; on a GPU
    # where the backend declares its accumulation, its truncating MMA then in the emulation; elsewhere the harness
    # keeps the worst-case term: harness.judge.expectation.allowances); its round_var holds only the roundings after
    # GEMM2's quantized input and the w2 LoRA's (e4m3 roundings are the flip terms' to allow: flip, flip_sq)
    track_var = magnitudes
    jobs = {} if mma1 is not None else {"c1": (xr, None)}     # every GEMM over w13 in one pass over the experts
    if track_var:   # GEMM1's fp32 accumulation over H (its input exact: the hidden states or their rounded product)
        jobs["var1"] = ((U32 * U32 * H) * xr * xr, "square")
        if apply_router_weight_on_input:     # the weighted input's two roundings, through w13^2
            jobs["rin1"] = (2.0 * xr * xr, "square")
    if magnitudes:
        jobs["s1"] = (xr.abs(), "abs")
        if apply_router_weight_on_input:                        # r(w), then r(x * r(w)), through |w13|
            jobs["u1"] = (1.0 + x[tok].abs(), "abs")
        if fp8 is not None:   # e4m3 flips of the input (the weighted input's two roundings widen the window)
            dt = hidden.dtype
            err = x_in.abs() * (eps(dt) * (1 + eps(dt))) if apply_router_weight_on_input else torch.zeros_like(x_in)
            jobs["flip1"] = (flip_allowance(x_in, err, fp8)[tok], "abs")
            slack_step = flip_step(x_in, torch.zeros_like(x_in), fp8)   # err 0: the scale arithmetic's window alone
    got = _per_expert_gemms(jobs, W13, e_flat, prec)
    del jobs
    c1 = got.pop("c1") if mma1 is None else mma1
    if b13 is not None:
        c1 = c1 + _per_expert_rows(b13, e_flat)
    cache1 = prec.r(c1).reshape(T, k, N1)
    if track_var:
        v1 = got.pop("var1")
        if fp8 is not None:   # the two scale multiplies of each product block (per channel: of the sum), sum p^2 from v1
            v1 = v1 * (1.0 + 2.0 / H) + (2.0 * U32 * U32) * c1 * c1
        var1 = (v1 + (U32 * U32 * (H + 1)) * c1 * c1).reshape(T, k, N1)
        del v1
        rnd1 = spacing_sq(cache1)         # cache1's rounding
        if apply_router_weight_on_input:
            rnd1 = rnd1 + got.pop("rin1").reshape(T, k, N1)
    if magnitudes:
        s1 = got.pop("s1")
        u1 = torch.ones_like(s1)                                # cache1's own rounding
        if apply_router_weight_on_input:
            u1 = u1 + got.pop("u1")
        if fp8 is not None:
            flip1 = got.pop("flip1")
        if b13 is not None:
            s1 = s1 + _per_expert_rows(b13.abs(), e_flat)
        scale1 = s1.reshape(T, k, N1)
        under1 = u1.reshape(T, k, N1)
        del s1, u1
    del x_in, xr, c1      # (P, H) and (P, N1) float64: freed as soon as they are spent (production sizes)

    layout = None
    coll = lora_collectives or LoRACollectives()
    w13_join = "w13" if coll.w13 is not None else None     # the joins this forward pauses at
    w2_join = "w2" if coll.w2 is not None else None
    if lora is not None:
        if not isinstance(lora, LoRAInputs):
            raise TypeError(f"lora must be a LoRAInputs, got {type(lora).__name__}")
        st = lora.stacked
        _check_lora(st, E, H, I, spec.gated, sharded=lora_collectives is not None)
        _check_devices(dev, **{"lora.token_lora_mapping": lora.token_lora_mapping,
                               "lora.stacked.adapter_enabled": st.adapter_enabled},
                       **{f"lora.stacked.{n}[{i}]": t for n in ("w13_a", "w13_b", "w2_a", "w2_b")
                          for i, t in enumerate(getattr(st, n))})
        if st.w2_b[0].shape[2] + w2_lora_offset > H:
            raise ValueError(f"w2_lora_offset={w2_lora_offset} + w2_b rows {st.w2_b[0].shape[2]} exceeds H={H}")
        layout = _layout(lora, local, T, k)
        if semantics.lora_top_k is not None:
            keep_pairs = layout.pair % k < semantics.lora_top_k
            layout = PairLayout(pair=layout.pair[keep_pairs], lora=layout.lora[keep_pairs],
                                expert=layout.expert[keep_pairs])
        # the w13 delta reads x by token, unweighted; the "weighted input" mistake reads x * w by pair
        x13, mul13 = (x[tok], True) if semantics.w13_lora_weighted else (x, False)
        x_abs, x_zero = (x13.abs(), torch.zeros_like(x13)) if magnitudes else (None, None)

        # w13 LoRA (x row = token, unweighted hidden states, mul_routed_weight False)
        if spec.interleaved and st.num_slices == 2:
            # delta computed in split layout into a zeroed dt buffer, then added interleaved: r(c + r(d))
            zeros = torch.zeros(T, k, 2 * I, dtype=_F64, device=dev)
            d, m, du, dv, dr = yield from _lora_delta(x13, st.w13_a, st.w13_b, x_abs, x_zero, zeros, None, w32,
                                                      layout, k, mul13, 0, prec, w13_join, add_inputs=False,
                                                      track_var=track_var)
            cache1 = prec.r(cache1 + _interleave(d, I))
            if magnitudes:
                scale1 = scale1 + _interleave(m, I)
                under1 = under1 + _interleave(du, I) + 1.0
            if track_var:
                var1 = var1 + _interleave(dv, I) + own_variance(cache1)
                rnd1 = rnd1 + _interleave(dr, I) + spacing_sq(cache1)
        else:
            cache1, m, under1, v1, r1 = yield from _lora_delta(x13, st.w13_a, st.w13_b, x_abs, x_zero, cache1,
                                                               under1, w32, layout, k, mul13, 0, prec, w13_join,
                                                               prev_var=var1, track_var=track_var, prev_round=rnd1)
            var1, rnd1 = (v1, r1) if track_var else (None, None)
            if magnitudes:
                scale1 = scale1 + m
        del x13, x_abs, x_zero

    # activation
    a = apply_activation(cache1.reshape(P, N1), spec.name, prec.dtype)
    cache1_exact = cache1.reshape(P, N1) if magnitudes and fp8 is not None else None   # the flips' starting point
    s2 = under2 = flip2 = var2 = rnd2 = None
    act_in = cache1.reshape(P, N1)
    ders = activation_derivatives(act_in, spec.name) if magnitudes else None    # one autograd pass for every magnitude
    e_dt = eps(hidden.dtype)
    R = int(lora.stacked.w2_a[0].shape[2]) if lora is not None else 0     # the whole rank, a sharded A or not
    if track_var:
        var2 = activation_variance(act_in, var1.reshape(P, N1), spec.name, own_ulps=ACT_ULPS, derivatives=ders)
        rnd2 = activation_variance(act_in, rnd1.reshape(P, N1), spec.name, own_ulps=0.0, derivatives=ders) + spacing_sq(a)
        # the second-order term (relu2's x^2 where an error moved x < 0 across 0), in each one's units: var's are
        # absolute; rnd's steps have variance eps_dt^2 rnd (compare.statistical_bound), so over eps_dt^2 its term is
        # 3 c^2 (eps_dt rnd)^2
        v_rem = activation_remainder(var1.reshape(P, N1), spec.name, variance=True)
        if v_rem is not None:
            var2 = var2 + v_rem
            rnd2 = rnd2 + activation_remainder(e_dt * rnd1.reshape(P, N1), spec.name, variance=True)
            del v_rem
    del var1, rnd1
    if magnitudes:
        s2 = activation_scale(act_in, scale1.reshape(P, N1), spec.name, derivatives=ders)
        # the same in rule 2's worst case: the input's error bound (GEMM1's over H + rank), its term in units of the
        # A_BOUND_ULPS eps_dt every scale is multiplied by at least when it becomes a bound
        rem = activation_remainder(_value_bound(scale1.reshape(P, N1), under1.reshape(P, N1), hidden.dtype, H + R),
                                   spec.name)
        if rem is not None:
            s2 = s2 + rem / (A_BOUND_ULPS * e_dt)
            del rem
        under2 = activation_scale(act_in, under1.reshape(P, N1), spec.name, own=False, derivatives=ders) + 1.0
        flushed, lost = activation_flush(act_in, spec.name)      # values whose factor fp32 may flush, whole
        under2.index_put_(flushed, lost / tiny(hidden.dtype), accumulate=True)
        if flip1 is not None:   # GEMM1's flips, carried through the activation (to first order, or across a kink)
            flip2 = torch.maximum(activation_scale(act_in, flip1, spec.name, own=False, derivatives=ders),
                                  _activation_change(act_in, flip1, spec))
    del act_in, ders
    del scale1, under1, flip1
    if not return_intermediates:
        del cache1

    # base GEMM2: cache3 = r(w * (a @ w2[e]^T + b2)) (unweighted when the weight went on the input); FP8: it reads
    # the quantized activation, the w2 LoRA below the unquantized `a`
    aq = fake_quantize_activation(a, fp8) if fp8 is not None else a
    mma3 = None if fp8_mma is None else _mma_gemm(a, fp8, fp8_mma.w2, e_flat, None, fp8_mma.tile)
    jobs = {} if mma3 is not None else {"c3": (aq, None)}     # every GEMM over w2 in one pass over the experts
    if track_var:   # GEMM2's accumulation over I, and the activation's variance carried by w2^2 (FP8: the quantized
        # activation absorbs it, but where it flips, which the flip terms allow)
        jobs["var3"] = ((var2 + (U32 * U32 * I) * a * a) if fp8 is None else (U32 * U32 * I) * aq * aq, "square")
        if fp8 is None:    # FP8: the quantized activation absorbs the roundings above it, but where it flips
            jobs["rnd3"] = (rnd2, "square")
    if magnitudes:
        jobs["s3"] = (s2 if fp8 is None else torch.maximum(s2, aq.abs()), "abs")
        jobs["u3"] = (under2, "abs")
        if fp8 is not None:   # GEMM1's flips carried here, and e4m3 flips of the activation, whose error the model
            dt = hidden.dtype   # bounds by its own rule 2 (those flips included)
            err = _value_bound(s2, under2, dt, H + R) + flip2
            allow2 = flip_allowance(a, err, fp8)
            jobs["f3"] = (flip2 + allow2, "abs")
    got = _per_expert_gemms(jobs, W2, e_flat, prec)
    del jobs
    c3 = got.pop("c3") if mma3 is None else mma3
    if b2 is not None:
        c3 = c3 + _per_expert_rows(b2, e_flat)
    var3 = rnd3 = None
    if track_var:
        var3 = got.pop("var3") + (U32 * U32 * (I + 1)) * c3 * c3
        if fp8 is not None:   # the scale multiplies, as at GEMM1
            var3 = var3 * (1.0 + 2.0 / I) + (2.0 * U32 * U32) * c3 * c3
        rnd3 = got.pop("rnd3") if fp8 is None else torch.zeros_like(c3)
    weight_out = not apply_router_weight_on_input or semantics.weight_on_output_too
    power = semantics.w2_lora_weight_power     # the w2 LoRA's routing weight (the contract: w, once)
    w2_weights = w32 if power == 1 else w32 ** power
    if weight_out:
        c3 = w_pair * c3
        if var3 is not None:    # times the fp32 weight, one more rounding
            var3 = w_pair * w_pair * var3 + own_variance(c3)
            rnd3 = w_pair * w_pair * rnd3
    cache3 = prec.r(c3).reshape(T, k, H)
    if var3 is not None:
        var3 = var3.reshape(T, k, H)
        rnd3 = rnd3.reshape(T, k, H) + spacing_sq(cache3)       # cache3's rounding
    del c3
    scale3 = under3 = flip3 = one3 = None
    if magnitudes:
        s3 = got.pop("s3")
        if b2 is not None:
            s3 = s3 + _per_expert_rows(b2.abs(), e_flat)
        u3 = got.pop("u3")
        if fp8 is not None:
            f3 = got.pop("f3")
            # one element j of the pair's activation flipped changes its output row by one step x column j of w2
            step = flip_step(a, err, fp8)
            reach = step * _per_expert_rows(_column_norms(W2), e_flat)    # (P, I)
            o3 = reach.amax(dim=1, keepdim=True)
            flip3 = (w_pair.abs() * f3 if weight_out else f3).reshape(T, k, H)
            one3 = (w_pair.abs() * o3 if weight_out else o3).reshape(T, k)
            # the flips of GEMM1's input that only a kernel's scale arithmetic takes (err 0): exact, one at a time,
            # through the base GEMM2 and the w2 LoRA together
            w2_lora = None
            if lora is not None:
                slot = torch.full((P,), -1, dtype=torch.int64, device=dev)
                slot[layout.pair] = layout.lora
                w2_lora = (slot, lora.stacked.w2_a[0], lora.stacked.w2_b[0], w2_lora_offset,
                           w2_weights.to(_F64).reshape(P))
            slack_base = _slack_flips(slack_step, cache1_exact, W13, W2, e_flat, k, spec,
                                      w_pair.abs().reshape(P) if weight_out else torch.ones(P, dtype=_F64, device=dev),
                                      w2_lora)
            flip_sq = _flip_squares(a, err, var2, rnd2, flip2 + tiny(dt) * under2, step, W2, e_flat, fp8, dt,
                                    w_pair if weight_out else None)
            del f3, o3, reach, step, err, allow2
        if weight_out:
            s3 = w_pair.abs() * s3
            u3 = w_pair.abs() * u3
        scale3 = s3.reshape(T, k, H)
        under3 = (u3 + 1.0).reshape(T, k, H)
        del s3, u3
    del aq

    # w2 LoRA (x row = pair, weighted by the routing weight even with apply_router_weight_on_input)
    if lora is not None:
        st = lora.stacked
        cache3, m, under3, v3, r3 = yield from _lora_delta(a, st.w2_a, st.w2_b, s2, under2, cache3, under3,
                                                           w2_weights, layout, k, True, w2_lora_offset, prec, w2_join,
                                                           x_var=var2, prev_var=var3, track_var=track_var,
                                                           x_round=rnd2, prev_round=rnd3)
        var3, rnd3 = (v3, r3) if track_var else (None, None)
        if magnitudes:
            scale3 = scale3 + m
        if flip3 is not None:   # the w2 LoRA reads the unquantized activation, off by GEMM1's flips
            a2_abs = [a2.abs() for a2 in st.w2_a]
            u_flip = lora_shrink(flip2, a2_abs, layout, k, True, _EXACT)
            flip3 = flip3 + _abs_expand(u_flip, st.w2_b, w2_weights, cache3, layout, k, True, w2_lora_offset)
            del u_flip, a2_abs
    del s2, under2, flip2, cache1_exact, slack_step, var2, rnd2
    if not return_intermediates:
        del a

    # moe_sum: fp32 accumulation (float64 here) of the k pair outputs, one rounding; non-local skipped
    keep = (local >= 0).to(_F64).unsqueeze(-1)
    out = prec.r((cache3 * keep).sum(dim=1))
    scale = (scale3 * keep).sum(dim=1) if magnitudes else None
    under = (under3 * keep).sum(dim=1) + 1.0 if magnitudes else None
    flips = {}
    if var3 is not None:   # moe_sum's own fp32 accumulation over the k pairs
        flips["acc_var"] = ((var3 * keep).sum(dim=1)
                            + dot_variance(out, (cache3 * cache3 * keep).sum(dim=1), k))
        # the output's own rounding is the judge's to add; FP8: for rule 4 alone (rule 2 keeps its worst case there)
        flips["round_var"] = (rnd3 * keep).sum(dim=1)
    if flip3 is not None:   # slack_flip: each pair's Gram bound (_slack_flips), the token's pairs added
        flips.update(flip=(flip3 * keep).sum(dim=1), one_flip=(one3 * keep[..., 0]).amax(dim=1),
                     slack_flip=(slack_base.reshape(T, k) * keep[..., 0]).sum(dim=1),
                     flip_sq=(flip_sq.reshape(T, k, H, 2) * keep[..., None]).sum(dim=1))
    if not return_intermediates:
        return ExpertExpected(value=out, scale=scale, underflow=under, **flips)
    return ExpertExpected(value=out, scale=scale, underflow=under, cache1=cache1, cache2=a.reshape(T, k, -1),
                          cache3=cache3, **flips)


def moe_experts_forward(*args, **kwargs) -> ExpertExpected:
    """The expert forward of one process (`forward_steps`' arguments): the layer, or one fully-sharded TP rank
    whose `lora_collectives` callables reach the other ranks, each join answered by its callable."""
    steps = forward_steps(*args, **kwargs)
    collectives = kwargs.get("lora_collectives")   # keyword-only
    try:
        which, partial = next(steps)
        while True:
            which, partial = steps.send(getattr(collectives, which)(partial))
    except StopIteration as done:
        return done.value


moe_experts_forward.__signature__ = inspect.signature(forward_steps).replace(return_annotation=ExpertExpected)


def _layout(lora: LoRAInputs, local: Tensor, T: int, k: int) -> PairLayout:
    """Qualifying (pair, slot, local expert) triples: naive-mode rules, optionally limited to lora_ids."""
    st = lora.stacked
    L = st.max_loras
    mapping = _int("lora.token_lora_mapping", lora.token_lora_mapping, (T,)).to(torch.int32)
    dev = local.device
    active = torch.full((L + 1,), -1, dtype=torch.int32, device=dev)
    uniq = torch.unique(mapping)
    active[:uniq.numel()] = uniq[: L + 1].to(torch.int32)
    layout = qualifying_pairs(
        None, local.reshape(-1).to(torch.int32), None, mapping, k, active,
        L + 1, st.adapter_enabled.to(torch.int32), T * k, L, 16,
    )
    if lora.lora_ids is not None:
        allowed = {int(v) for v in lora.lora_ids.reshape(-1).tolist() if v >= 0}
        keep = torch.tensor([int(l) in allowed for l in layout.lora.tolist()], dtype=torch.bool, device=dev)
        layout = PairLayout(pair=layout.pair[keep], lora=layout.lora[keep], expert=layout.expert[keep])
    return layout
