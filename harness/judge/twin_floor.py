"""Rule 3's accumulation term for a row, measured by the twin run instead of bounded for every summation order.

A row's accumulation error `a` (the kernel's output less its emulation) and its twin's `b` (the same sums in another
order) are, under the probabilistic model, Gaussian per element with variances s_i^2 and correlation rho <= TWIN_RHO
(rule 4's assumption: compare.TWIN_FACTOR). Rule 3 allows the row ||a|| <= 2 kappa ||a - b|| (KAPPA_TAIL;
compare.rule3_base). `row_kappa` finds, per row, the smallest kappa for which a Chernoff bound puts
P(||a||^2 > 4 kappa^2 ||a - b||^2) under the row's share of FALSE_VERDICT, squared (the bound then holds for rows
of half the effective elements the weights say). The weights s_i^2 follow the reference's per-element variance bound
(acc_var): only their shape enters. docs/error-model.md, "Rule 3 with the twin".
"""
from __future__ import annotations

import functools
import math

import torch

# a weight's bin: its log2 in steps of BIN below the row's largest; a bin counts its weights at their largest for the
# positive eigenvalue's terms and at their smallest for the negative's (conservative both ways: the first grow with
# the weight, the second shrink); weights under 2^-DEPTH of the row's largest are counted in the lowest bin at its
# largest for the positive terms and left out of the negative ones
BIN = 0.25
DEPTH = 12
_C_STEPS = 14      # bisection steps over log c (c = 4 kappa^2) within _C_RANGE: kappa to 0.1 %
# the bound's event is ||a|| <= KAPPA_TAIL kappa ||a - b|| (c = KAPPA_TAIL^2 kappa^2): what rule 3 allows a row's
# twin-measured accumulation (compare.rule3_base)
KAPPA_TAIL = 2.0
_T_GRID = torch.linspace(0.05, 0.95, 12, dtype=torch.float64)   # t as a fraction of the largest the bound allows
_C_RANGE = (0.1, 1e5)


def _eigen(c: torch.Tensor, rho: float):
    """The eigenvalues (l1 > 0 > l2) of one element's quadratic form z^2 - c ((1 - rho) z - sqrt(1 - rho^2) w)^2 in
    independent standard normals (z, w): a = s z, a - b = s ((1 - rho) z - sqrt(1 - rho^2) w)."""
    tr = 1.0 - 2.0 * c * (1.0 - rho)
    det = -c * (1.0 - rho * rho)
    disc = torch.sqrt(tr * tr - 4.0 * det)
    return (tr + disc) / 2.0, (tr - disc) / 2.0


ROWS_AT_ONCE = 2048    # rows whose bounds are searched together (memory: rows x 12 x 49 doubles, a few times)


def row_kappa(acc_var: torch.Tensor, written: torch.Tensor, log_delta: float, rho: float) -> torch.Tensor:
    """(T,) float64: each row's kappa (module docstring) at the tail exp(log_delta) (already squared by the caller),
    inf for a row without accumulation weights."""
    if acc_var.shape[0] > ROWS_AT_ONCE:
        return torch.cat([row_kappa(acc_var[i:i + ROWS_AT_ONCE], written[i:i + ROWS_AT_ONCE], log_delta, rho)
                          for i in range(0, acc_var.shape[0], ROWS_AT_ONCE)])
    v = torch.where(written, acc_var.to(torch.float64).clamp_min(0), torch.zeros((), dtype=torch.float64,
                                                                                  device=acc_var.device))
    v = v.reshape(v.shape[0], -1)
    total = v.sum(dim=1, keepdim=True)
    live = total[:, 0] > 0
    w = v / torch.where(total > 0, total, torch.ones_like(total))
    nb = int(DEPTH / BIN) + 1
    top = torch.floor(torch.log2(w.amax(dim=1, keepdim=True).clamp_min(1e-300)) / BIN)    # the largest's bin
    below = top - torch.floor(torch.log2(w.clamp_min(1e-300)) / BIN)                     # 0: the largest's bin
    rel = below.clamp(0, nb - 1).long()
    pos = w > 0
    neg = pos & (below <= nb - 1)
    shape = (v.shape[0], nb)
    counts_pos = torch.zeros(shape, dtype=torch.float64, device=v.device).scatter_add_(1, rel, pos.to(torch.float64))
    counts_neg = torch.zeros(shape, dtype=torch.float64, device=v.device).scatter_add_(1, rel, neg.to(torch.float64))
    w_up = torch.zeros(shape, dtype=torch.float64, device=v.device).scatter_reduce_(
        1, rel, torch.where(pos, w, torch.zeros_like(w)), "amax")
    w_lo = torch.ones(shape, dtype=torch.float64, device=v.device).scatter_reduce_(
        1, rel, torch.where(neg, w, torch.ones_like(w)), "amin")
    w_lo = torch.where(counts_neg > 0, w_lo, torch.zeros_like(w_lo))
    wmax = w_up[:, 0]
    grid = _T_GRID.to(v.device)

    def fails(c):   # whether no t in the grid brings the bound under the tail: c too small
        l1, l2 = _eigen(c, rho)                                                           # (T,)
        tmax = 1.0 / (2.0 * l1 * wmax.clamp_min(1e-300))
        t = grid[None, :] * tmax[:, None]                                                 # (T, G)
        x1 = 2.0 * t[:, :, None] * l1[:, None, None] * w_up[:, None, :]                    # (T, G, nb)
        x2 = 2.0 * t[:, :, None] * l2[:, None, None] * w_lo[:, None, :]
        f = -0.5 * (counts_pos[:, None, :] * torch.log1p(-x1) + counts_neg[:, None, :] * torch.log1p(-x2)).sum(-1)
        return f.amin(dim=1) > log_delta

    lo = torch.full((v.shape[0],), math.log(_C_RANGE[0]), dtype=torch.float64, device=v.device)
    hi = torch.full_like(lo, math.log(_C_RANGE[1]))
    for _ in range(_C_STEPS):
        mid = (lo + hi) / 2.0
        bad = fails(torch.exp(mid))
        lo, hi = torch.where(bad, mid, lo), torch.where(bad, hi, mid)
    kappa = torch.sqrt(torch.exp(hi)) / KAPPA_TAIL
    reached = ~fails(torch.exp(hi))
    return torch.where(live & reached, kappa, torch.full_like(kappa, math.inf))


@functools.lru_cache(maxsize=256)
def _uniform_kappa(m: int, log_delta: float, rho: float) -> float:
    return float(row_kappa(torch.ones(1, m, dtype=torch.float64), torch.ones(1, m, dtype=torch.bool), log_delta,
                           rho)[0])


def kappa_lower_bound(counts: torch.Tensor, log_delta: float, rho: float) -> torch.Tensor:
    """(T,) float64: a lower bound of each row's `row_kappa`, from its count of weighted elements alone: both sums of
    Chernoff's exponent are convex in each weight, so equal weights over the same elements minimise it (Schur), and
    their kappa is the least any row of that many elements can have. Cheap: one search per distinct count."""
    out = torch.full(counts.shape, math.inf, dtype=torch.float64, device=counts.device)
    for m in torch.unique(counts).tolist():
        if m > 0:
            out[counts == m] = _uniform_kappa(int(m), log_delta, rho)
    return out


def at_most_sources(kappa: torch.Tensor, sources: int | None, log_delta: float, rho: float) -> torch.Tensor:
    """`kappa` of rows whose errors come from at most `sources` independent values (an op's rank intermediates: a
    row of N elements that are functions of two values is two draws, not N): at least the least kappa a row of that
    many elements can have (`kappa_lower_bound`'s, equal weights). None: every element its own."""
    if sources is None:
        return kappa
    return torch.maximum(kappa, torch.full_like(kappa, _uniform_kappa(max(int(sources), 1), log_delta, rho)))
