"""MoE activations of vLLM 0.33.0 (spec 6): exact float64 values and the production kernels' rounding.

Gated activations read gate/up from the w13 output: split layout `[g(I); u(I)]`, except `swigluoai`
which is interleaved `[g0, u0, g1, u1, ...]`. `relu2` is a listed enum member that the Triton
experts reject, so it is in ACTIVATIONS but not in SUPPORTED_ACTIVATIONS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .precision import rnd

# Constants of the production kernels (spec 6).
OAI_ALPHA = 1.702
OAI_LIMIT = 7.0
UNINTERLEAVE_BETA = 1.0  # silu_and_mul_with_clamp(limit, alpha, beta): up term is (u' + beta)
STEP_LIMIT = 7.0
# vLLM takes SiTU's betas from the model config (FusedMoEConfig.activation_situ_beta / _linear_beta,
# no default there); these are Kimi-K3's values. linear_beta None or <= 0 passes `up` through.
SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0

_ALIASES = {"gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ActivationSpec:
    """One MoEActivation member: its name, whether it is gated, and whether gate/up interleave."""

    name: str
    gated: bool
    interleaved: bool


ACTIVATIONS: dict[str, ActivationSpec] = {
    s.name: s
    for s in (
        ActivationSpec("silu", True, False),
        ActivationSpec("gelu", True, False),
        ActivationSpec("gelu_tanh", True, False),
        ActivationSpec("relu2", True, False),
        ActivationSpec("swigluoai", True, True),
        ActivationSpec("situ", True, False),
        ActivationSpec("swigluoai_uninterleave", True, False),
        ActivationSpec("swiglustep", True, False),
        ActivationSpec("silu_no_mul", False, False),
        ActivationSpec("gelu_no_mul", False, False),
        ActivationSpec("gelu_tanh_no_mul", False, False),
        ActivationSpec("relu2_no_mul", False, False),
    )
}
UNSUPPORTED_ACTIVATIONS = ("relu2",)
# activations whose production formula cancels: x (1 + erf(x / sqrt 2)) / 2 and its tanh form tend to 0 from x << 0
# through 1 + (-1 + tiny), so fp32 evaluates them with an error of u |x|, not u |h| (gelu(-6) ~ -6e-9); the error
# models' own term of the activation is relative to the argument for these (activation_scale, activation_variance)
ARGUMENT_RELATIVE = ("gelu", "gelu_tanh", "gelu_no_mul", "gelu_tanh_no_mul")
SUPPORTED_ACTIVATIONS = tuple(n for n in ACTIVATIONS if n not in UNSUPPORTED_ACTIVATIONS)


def lookup_activation(name: str, *, supported_only: bool = True) -> ActivationSpec:
    """Resolve `name` (alias `gelu_pytorch_tanh` accepted) to its spec; unknown/unsupported -> ValueError."""
    if not isinstance(name, str):
        raise TypeError(f"activation name must be a str; got {type(name).__name__}")
    key = _ALIASES.get(name, name)
    spec = ACTIVATIONS.get(key)
    if spec is None or (supported_only and key in UNSUPPORTED_ACTIVATIONS):
        why = "is not supported by the Triton MoE experts" if spec is not None else "is unknown"
        raise ValueError(
            f"activation {name!r} {why}; supported activations: {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    return spec


def is_gated(name: str) -> bool:
    """True for gated (act(gate) * up) members, i.e. names not ending in `_no_mul`."""
    return lookup_activation(name, supported_only=False).gated


def output_width(name: str, n1: int) -> int:
    """Width I of the activation output for a w13 output of width `n1` (n1 // 2 if gated)."""
    spec = lookup_activation(name)
    if not isinstance(n1, int) or n1 <= 0:
        raise ValueError(f"n1 must be a positive int; got {n1!r}")
    if spec.gated:
        if n1 % 2:
            raise ValueError(f"n1 must be even for gated activation {spec.name!r}; got {n1}")
        return n1 // 2
    return n1


# ---------------------------------------------------------------- exact float64 formulas


def _silu(x):
    return x * torch.sigmoid(x)


def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _relu2(x):
    return torch.relu(x) ** 2


def _situ_gate(g, beta):
    return beta * torch.tanh(g / beta) * torch.sigmoid(g)


def _situ_up(u, linear_beta):
    if linear_beta is None or linear_beta <= 0:
        return u
    return linear_beta * torch.tanh(u / linear_beta)


def _clamp_gate_up(g, u, limit):
    return torch.clamp(g, max=limit), torch.clamp(u, min=-limit, max=limit)


_NO_MUL = {
    "silu_no_mul": _silu,
    "gelu_no_mul": _gelu,
    "gelu_tanh_no_mul": _gelu_tanh,
    "relu2_no_mul": _relu2,
}
# half the largest |h''| of each non-gated form: |h(x + e) - h(x) - h'(x) e| <= c e^2 for every x and e (h' is
# 2c-Lipschitz), the second-order term first-order magnitudes leave out. It matters where h and h' vanish together
# while the input errs: relu2 at x < 0 has truth 0, slope 0 and no rounding of its own, and a kernel's x rounded to the
# other sign gives x^2 (activation_remainder). A gated form's first-order terms vanish together only where both
# factors' truths are exact zeros at once, which no drawn input reaches.
CURVATURE = {"silu_no_mul": 0.25, "gelu_no_mul": 0.4, "gelu_tanh_no_mul": 0.4, "relu2_no_mul": 1.0}
_ACT_THEN_MUL = {"silu": _silu, "gelu": _gelu, "gelu_tanh": _gelu_tanh}  # rnd(rnd(f(g)) * u)


def _gated_parts(name, g, u, situ_beta, situ_linear_beta):
    """(a, m) with exact output a * m; `a` is the factor a production kernel rounds first (if any)."""
    if name in _ACT_THEN_MUL:
        return _ACT_THEN_MUL[name](g), u
    if name == "swigluoai":
        g, u = _clamp_gate_up(g, u, OAI_LIMIT)
        return g * torch.sigmoid(OAI_ALPHA * g), u + 1.0
    if name == "swigluoai_uninterleave":
        g, u = _clamp_gate_up(g, u, OAI_LIMIT)
        return g * torch.sigmoid(OAI_ALPHA * g), u + UNINTERLEAVE_BETA
    if name == "swiglustep":
        return torch.clamp(_silu(g), max=STEP_LIMIT), torch.clamp(u, min=-STEP_LIMIT, max=STEP_LIMIT)
    if name == "situ":
        return _situ_gate(g, situ_beta), _situ_up(u, situ_linear_beta)
    raise AssertionError(name)  # unreachable: names are validated first


def _split(x: torch.Tensor, spec: ActivationSpec, arg: str):
    n1 = x.shape[-1]
    if n1 % 2:
        raise ValueError(
            f"{arg} must have an even last dimension (2*I) for gated activation {spec.name!r}; "
            f"got shape {tuple(x.shape)}"
        )
    if spec.interleaved:
        return x[..., 0::2], x[..., 1::2]
    return x[..., : n1 // 2], x[..., n1 // 2 :]


def _as_f64(x, arg: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{arg} must be a floating-point torch.Tensor of shape (M, N1)")
    if x.dim() < 1:
        raise ValueError(f"{arg} must have shape (M, N1); got a 0-d tensor")
    return x.to(torch.float64)


def _exact(x, spec, situ_beta, situ_linear_beta):
    if not spec.gated:
        return _NO_MUL[spec.name](x)
    g, u = _split(x, spec, "x")
    a, m = _gated_parts(spec.name, g, u, situ_beta, situ_linear_beta)
    return a * m


def apply_activation(
    x: torch.Tensor,
    name: str,
    dtype: torch.dtype | None = None,
    *,
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float | None = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """Activation of `x` (M, N1) in float64 -> (M, I); with `dtype`, the production kernel's roundings.

    Emulation (x assumed already representable in dtype): silu/gelu/gelu_tanh rnd(rnd(f(g)) * u);
    swigluoai, situ, swiglustep one rounding of the fp32 result; swigluoai_uninterleave
    rnd(fp32(rnd(g' sigmoid(alpha g')) * fp32(u' + beta))); `_no_mul` forms rnd(f(x)).
    """
    spec = lookup_activation(name)
    x = _as_f64(x, "x")
    if dtype is None:
        return _exact(x, spec, situ_beta, situ_linear_beta)
    if not spec.gated:
        return rnd(_NO_MUL[spec.name](x), dtype)
    g, u = _split(x, spec, "x")
    a, m = _gated_parts(spec.name, g, u, situ_beta, situ_linear_beta)
    if spec.name in _ACT_THEN_MUL:
        return rnd(rnd(a, dtype) * m, dtype)
    if spec.name == "swigluoai_uninterleave":
        f32 = torch.float32
        return rnd(rnd(rnd(a, dtype) * rnd(m, f32), f32), dtype)
    return rnd(a * m, dtype)


def activation_derivatives(x: torch.Tensor, name: str, *, situ_beta: float = SITU_BETA,
                           situ_linear_beta: float | None = SITU_LINEAR_BETA) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, dh/dx) of the exact activation at `x` (float64): its value and one partial per input element, computed
    once for every magnitude the reference carries through the activation (activation_scale, activation_variance)."""
    spec = lookup_activation(name)
    x = _as_f64(x, "x")
    with torch.enable_grad():
        xg = x.detach().clone().requires_grad_(True)
        h = _exact(xg, spec, situ_beta, situ_linear_beta)
        (grad,) = torch.autograd.grad(h.sum(), xg)  # elementwise: one partial per input element
    return h.detach(), grad


# fp32's smallest normal: where an activation's factor (sigmoid, Phi: its output over its argument) falls below it,
# an fp32 evaluation may lose it whole (1 / (1 + exp(-x)) with exp(-x) overflowing past x < -88.7; a GPU's exp
# flushing subnormal results): silu(-89) is -2e-37 and a correct kernel returns 0 (activation_flush)
FP32_NORMAL_MIN = 2.0 ** -126


FLUSH_ROWS = 4096    # rows of the activation's input activation_flush examines at once (its temporaries' size)


def activation_flush(x: torch.Tensor, name: str, *, situ_beta: float = SITU_BETA,
                     situ_linear_beta: float | None = SITU_LINEAR_BETA) -> tuple[tuple, torch.Tensor]:
    """The elements of the activation's output an fp32 evaluation may lose by a factor below fp32's normal range,
    and the absolute error each may take: (index, |f m|) where a gated output f(g) m has |f| < 2^-126 |g|
    (non-gated: |h| where |h| < 2^-126 |x|); such values are under 2^-126 times the argument, so nothing else is
    touched. Sparse, and computed FLUSH_ROWS rows at a time: a served layer's (T k, I) is gigabytes in float64."""
    spec = lookup_activation(name)
    x = _as_f64(x, "x")
    rows, cols, lost = [], [], []
    for r0 in range(0, x.shape[0], FLUSH_ROWS):
        xc = x[r0:r0 + FLUSH_ROWS]
        if spec.gated:
            g, u = _split(xc, spec, "x")
            f, m = _gated_parts(spec.name, g, u, situ_beta, situ_linear_beta)
        else:
            g, f, m = xc, _NO_MUL[spec.name](xc), torch.ones_like(xc)
        r, c = torch.nonzero(f.abs() < FP32_NORMAL_MIN * g.abs(), as_tuple=True)
        rows.append(r + r0)
        cols.append(c)
        lost.append((f[r, c] * m[r, c]).abs())
    empty = torch.zeros(0, dtype=torch.long, device=x.device)
    cat = lambda ts, e: torch.cat(ts) if ts else e  # noqa: E731
    return (cat(rows, empty), cat(cols, empty)), cat(lost, empty.to(torch.float64))


def _own_magnitude(h: torch.Tensor, x: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """What the activation's own error scales with: |h|, plus the argument (|x|, gated |g u|) for the
    ARGUMENT_RELATIVE activations, whose fp32 evaluation errs relative to it."""
    if spec.name not in ARGUMENT_RELATIVE:
        return h.abs()
    if not spec.gated:
        return h.abs() + x.abs()
    g, u = _split(x, spec, "x")
    return h.abs() + (g * u).abs()


def activation_scale(
    x: torch.Tensor,
    xscale: torch.Tensor,
    name: str,
    *,
    situ_beta: float = SITU_BETA,
    situ_linear_beta: float | None = SITU_LINEAR_BETA,
    own: bool = True,
    derivatives: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """First-order error magnitude of the activation output given input error magnitudes `xscale`.

    Gated h(g, u): |dh/dg| xs_g + |dh/du| xs_u + |h| (for act-and-mul: |f'(g)| xs_g |u| + |f(g)| xs_u
    + |f(g) u|); non-gated: |f'(x)| xs + |f(x)|. The |h| term carries the output's own rounding; for the
    ARGUMENT_RELATIVE activations (gelu's forms, whose formula cancels for x << 0) it is |h| + |g u| (|h| + |x|),
    the fp32 evaluation's error being relative to the argument (`own=False` leaves it out: the input errors carried
    through alone). `derivatives`: activation_derivatives(x, name) when the caller has them.
    """
    spec = lookup_activation(name)
    x = _as_f64(x, "x")
    xscale = _as_f64(xscale, "xscale")
    if xscale.shape != x.shape:
        raise ValueError(f"xscale must have the shape of x {tuple(x.shape)}; got {tuple(xscale.shape)}")
    if bool((xscale < 0).any()) or not bool(torch.isfinite(xscale).all()):
        raise ValueError("xscale must be finite and >= 0")
    h, grad = derivatives or activation_derivatives(x, name, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    mine = _own_magnitude(h, x, spec) if own else torch.zeros_like(h)
    if not spec.gated:
        return grad.abs() * xscale + mine
    dg, du = _split(grad, spec, "x")
    sg, su = _split(xscale, spec, "xscale")
    return dg.abs() * sg + du.abs() * su + mine


def activation_remainder(err: torch.Tensor, name: str, *, variance: bool = False) -> torch.Tensor | None:
    """The activation's second-order term beside its first-order magnitudes, per element: `CURVATURE` c times the
    input's error bound `err` squared; with `variance`, `err` the input error's variance and the term's second moment
    3 c^2 err^2 (a Gaussian error's fourth moment). None for a gated form (no CURVATURE entry)."""
    c = CURVATURE.get(lookup_activation(name).name)
    if c is None:
        return None
    err = _as_f64(err, "err")
    return 3.0 * c * c * err * err if variance else c * err * err


def activation_variance(x: torch.Tensor, xvar: torch.Tensor, name: str, *, own_ulps: float,
                        situ_beta: float = SITU_BETA, situ_linear_beta: float | None = SITU_LINEAR_BETA,
                        derivatives: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """First-order variance of the activation output given independent input error variances `xvar`:
    (dh/dg)^2 var_g + (dh/du)^2 var_u (non-gated h'^2 var), plus the output's own fp32 evaluation error
    (own_ulps 2^-24 |h|)^2, (own_ulps 2^-24 (|h| + |g u|))^2 for the ARGUMENT_RELATIVE activations (non-gated
    |h| + |x|; reference.accumulation: the statistical model). `derivatives`: as activation_scale's."""
    spec = lookup_activation(name)
    x = _as_f64(x, "x")
    xvar = _as_f64(xvar, "xvar")
    if xvar.shape != x.shape:
        raise ValueError(f"xvar must have the shape of x {tuple(x.shape)}; got {tuple(xvar.shape)}")
    h, grad = derivatives or activation_derivatives(x, name, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    own = (own_ulps * 2.0 ** -24) ** 2 * _own_magnitude(h, x, spec) ** 2
    g2 = grad * grad
    if not spec.gated:
        return g2 * xvar + own
    dg, du = _split(g2, spec, "x")
    vg, vu = _split(xvar, spec, "xvar")
    return dg * vg + du * vu + own
