"""What more twins would buy rule 3 on one row: kappa for one, two and three twins, at each correlation rho.

Rule 3 allows a twin-measured row ||a|| <= 2 kappa ||a - b|| (harness/judge/twin_floor.py). With n twins the measure
would be the mean of ||a - b_i||^2, each pair of runs correlated at rho. kappa comes from the same Chernoff bound at
the same tail (FALSE_VERDICT squared), for m equal weights; "grant" is what the rule then allows over ||a|| where the
runs' errors are in fact independent (E||a - b||^2 = 2 ||a||^2). One twin's column is twin_floor's own (checked).

    python bench/second_twin_kappa.py
"""
from __future__ import annotations

import math

import numpy as np

from moe_lora_harness.harness.judge.compare import FALSE_VERDICT, TWIN_RHO
from moe_lora_harness.harness.judge.twin_floor import KAPPA_TAIL, _uniform_kappa

LOG_DELTA = 2.0 * math.log(FALSE_VERDICT)


def kappa(m: int, twins: int, rho: float) -> float:
    """The least kappa with P(||a||^2 > (KAPPA_TAIL kappa)^2 mean_i ||a - b_i||^2) <= exp(LOG_DELTA) by Chernoff's
    bound, m elements of equal weight, every pair of the twins + 1 runs correlated at rho."""
    n = twins + 1
    cov = np.full((n, n), rho)
    np.fill_diagonal(cov, 1.0)
    root = np.linalg.cholesky(cov)

    def holds(c: float) -> bool:
        form = np.zeros((n, n))
        form[0, 0] = 1.0
        for i in range(1, n):
            v = np.zeros(n)
            v[0], v[i] = 1.0, -1.0
            form -= (c / twins) * np.outer(v, v)
        lam = np.linalg.eigvalsh(root.T @ form @ root)
        ts = np.linspace(0.005, 0.995, 400) / (2.0 * lam.max())
        return min(-0.5 * m * np.log1p(-2.0 * t * lam).sum() for t in ts) <= LOG_DELTA

    lo, hi = math.log(1e-2), math.log(1e5)
    for _ in range(40):
        mid = (lo + hi) / 2.0
        lo, hi = (lo, mid) if holds(math.exp(mid)) else (mid, hi)
    return math.sqrt(math.exp(hi)) / KAPPA_TAIL


def main() -> None:
    for rho in (TWIN_RHO, 0.3, 0.0):
        print(f"rho {rho:.3f}: m, kappa for 1 / 2 / 3 twins (twin_floor's for 1), grant over ||a|| if independent")
        for m in (64, 256, 1024, 4096):
            ks = [kappa(m, n, rho) for n in (1, 2, 3)]
            grants = " / ".join(f"{KAPPA_TAIL * k * math.sqrt(2.0):.2f}" for k in ks)
            print(f"  {m:5d}  {ks[0]:.3f} / {ks[1]:.3f} / {ks[2]:.3f}  ({_uniform_kappa(m, LOG_DELTA, rho):.3f})"
                  f"  grant {grants}")


if __name__ == "__main__":
    main()
