"""How far the e4m3 MMA's accumulation lies from the exact dot, against a candidate statistical bound built from its
rule (a study for the next step of docs/error-model.md's FP8 item; not a test, no verdict reads it).

reference/fp8_mma.py is the hardware's arithmetic bit for bit (checked on an H100), so its error can be studied on a
CPU. The candidate: every MMA step truncates at most 33 terms (C and 32 products) toward zero to its unit
u = 2^(E - 13), and its sum to 14 significant bits; taking each truncation as uniform within its unit, independent,
the error's variance is at most sum over steps of (n_inexact u^2 + ulp14(s)^2) / 3. The cheap form a judge could
afford bounds E by the largest exponent of the step's a-chunk plus that of its b-chunk (an outer sum per 32-product
chunk) and C's exponent by the partial sums (one GEMM per chunk); here n_inexact is taken as 33. Printed per data
kind, layout (chained, promoted every 128) and K: the largest and the 99.9th-percentile ratio |error| / sd over
the results, and the mean signed error in sd (a bias the truncations' signs leave). Data kinds: normal x 16;
activation-like (|normal| x 16 against normal weights: products of random sign); all-positive (the worst case
for the bias).

  PYTHONPATH=src python bench/fp8_mma_bound_study.py
"""
from __future__ import annotations

import torch

from moe_lora_harness.reference.fp8_mma import RESULT_BITS, STEP, WINDOW_BITS, exponent, mma_dot

F64 = torch.float64


def candidate_sd(a: torch.Tensor, b: torch.Tensor, c0: torch.Tensor, tile: int | None) -> torch.Tensor:
    """The candidate bound's standard deviation per result (module doc), from per-chunk largest exponents and the
    exact running partial sums (what the MMA holds as C, to within its own error)."""
    K = a.shape[1]
    var = torch.zeros_like(c0)
    run = c0.clone()
    for k0 in range(0, K, STEP):
        if tile is not None and k0 % tile == 0:
            run = torch.zeros_like(c0)                              # a promoted tile's C restarts at zero
        ea = exponent(a[:, k0:k0 + STEP]).amax(dim=1)
        eb = exponent(b[:, k0:k0 + STEP]).amax(dim=1)
        e = torch.maximum(ea[:, None] + eb[None, :], exponent(run))
        unit = torch.ldexp(torch.ones_like(c0), e - WINDOW_BITS)
        run = run + a[:, k0:k0 + STEP] @ b[:, k0:k0 + STEP].t()
        ulp = torch.ldexp(torch.ones_like(c0), exponent(run) + 1 - RESULT_BITS)
        var = var + (33 * unit * unit + ulp * ulp) / 3
    return var.sqrt()


def main() -> int:
    g = torch.Generator().manual_seed(3)

    def e4m3(x):
        return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(F64)

    kinds = {
        "normal": lambda M, N, K: (torch.randn(M, K, generator=g, dtype=F64) * 16,
                                   torch.randn(N, K, generator=g, dtype=F64) * 16),
        "activation-like": lambda M, N, K: (torch.randn(M, K, generator=g, dtype=F64).abs() * 16,
                                            torch.randn(N, K, generator=g, dtype=F64) * 16),
        "all-positive": lambda M, N, K: (torch.randn(M, K, generator=g, dtype=F64).abs() * 16,
                                         torch.randn(N, K, generator=g, dtype=F64).abs() * 16),
    }
    M = N = 64
    print(f"{'data':16s} {'layout':14s} {'K':>5s} {'max |err|/sd':>13s} {'p99.9':>7s} {'mean err/sd':>12s}")
    for kind, draw in kinds.items():
        for K in (256, 2048):
            x, w = draw(M, N, K)
            a, b = e4m3(x), e4m3(w)
            c0 = torch.zeros(M, N, dtype=F64)
            exact = a @ b.t()
            for tile, name in ((None, "chained"), (128, "promoted 128")):
                err = mma_dot(a, b, c0, tile) - exact
                r = (err / candidate_sd(a, b, c0, tile)).flatten()
                print(f"{kind:16s} {name:14s} {K:5d} {float(r.abs().max()):13.3g} "
                      f"{float(torch.quantile(r.abs(), 0.999)):7.3g} {float(r.mean()):12.3g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
