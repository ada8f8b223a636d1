"""The statistical model of fp32 accumulation: how far a correct kernel's inner products may drift from exact ones.

A kernel sums an inner product of n products in fp32, in an order of its own. Each addition errs by a relative
delta_v, |delta_v| <= u = 2^-24, and the error of the result is sum_v delta_v S_v over the additions' exact partial
sums S_v (Higham and Mary 2019: the deltas independent and of mean zero). Its variance is at most u^2 sum_v S_v^2.
For any order (a sequential loop is the worst: most additions see large partial sums) and products whose order is
independent of their values, E sum_v S_v^2 <= n (y^2 + sum_k p_k^2), y the exact result: a mean drift makes the
partial sums grow like (i/n) y, a random walk like sqrt(i/n) of the products' root-sum-square, and one dominant
product like itself. So the variance bound of one inner product is `u^2 n (y^2 + sum p^2)`; a later linear step
carries an earlier variance by squared coefficients (first order). docs/error-model.md, "The statistical model".
"""
from __future__ import annotations

import torch

U32 = 2.0 ** -24          # fp32's unit roundoff (half its epsilon)
ACT_ULPS = 4.0            # an activation evaluated in fp32 (exp, erf, tanh): at most this many u of its value


def dot_variance(value: torch.Tensor, sumsq: torch.Tensor, n: int) -> torch.Tensor:
    """Variance bound of the fp32 accumulation error of inner products of `n` terms: u^2 n (value^2 + sum p^2).
    `value` the exact results, `sumsq` the sums of their squared products (both float64, same shape)."""
    return (U32 * U32 * max(int(n), 1)) * (value * value + sumsq)


def own_variance(value: torch.Tensor, ulps: float = 1.0) -> torch.Tensor:
    """Variance bound of one fp32 operation's own error on `value` (a product, a sum of two, a function value):
    (ulps u |value|)^2."""
    return (ulps * U32) ** 2 * (value * value)

