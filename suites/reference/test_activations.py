"""Tests of reference/activations.py: each activation against a direct formula, its rounding emulation
(fp16 via numpy's correctly rounded casts, an independent oracle), the error-scale, and bad input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_lora_harness.reference.activations import (
    ACTIVATIONS,
    CURVATURE,
    FP32_NORMAL_MIN,
    SUPPORTED_ACTIVATIONS,
    activation_derivatives,
    activation_flush,
    activation_remainder,
    activation_scale,
    apply_activation,
    is_gated,
    lookup_activation,
    output_width,
)
from moe_lora_harness.reference.precision import rnd

F64 = torch.float64
# Exact-mode results and the test's formulas evaluate the same closed form in float64 in different
# algebraic orders; for |x| <= 12 their difference is a few float64 ulps of the operands' scale.
F64_TOL = dict(rtol=1e-13, atol=1e-13)


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _direct(name, x):
    """Spec-6 formulas in numpy float64, written independently of the module under test."""
    x = x.numpy()
    n1 = x.shape[-1]
    g, u = (x[:, 0::2], x[:, 1::2]) if name == "swigluoai" else (x[:, : n1 // 2], x[:, n1 // 2 :])
    erf = np.vectorize(math.erf)
    silu = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731
    gelu = lambda v: 0.5 * v * (1.0 + erf(v / math.sqrt(2.0)))  # noqa: E731
    gelu_t = lambda v: 0.5 * v * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))  # noqa: E731
    if name == "silu":
        return silu(g) * u
    if name == "gelu":
        return gelu(g) * u
    if name == "gelu_tanh":
        return gelu_t(g) * u
    if name in ("swigluoai", "swigluoai_uninterleave"):
        gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return (uc + 1.0) * gc * _sig(1.702 * gc)
    if name == "swiglustep":
        return np.minimum(silu(g), 7.0) * np.clip(u, -7.0, 7.0)
    if name == "situ":
        return 4.0 * np.tanh(g / 4.0) * _sig(g) * (25.0 * np.tanh(u / 25.0))
    return {"silu_no_mul": silu, "gelu_no_mul": gelu, "gelu_tanh_no_mul": gelu_t,
            "relu2_no_mul": lambda v: np.maximum(v, 0.0) ** 2}[name](x)


def _h(v):  # numpy correctly rounded float64 -> fp16 -> float64
    return np.asarray(v, dtype=np.float64).astype(np.float16).astype(np.float64)


def _f(v):
    return np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float64)


def _emulated(name, x):
    """Spec-6 production rounding for fp16, with numpy as the rounding oracle."""
    xn = x.numpy()
    n1 = xn.shape[-1]
    g, u = (xn[:, 0::2], xn[:, 1::2]) if name == "swigluoai" else (xn[:, : n1 // 2], xn[:, n1 // 2 :])
    if name in ("silu", "gelu", "gelu_tanh"):
        one = torch.from_numpy(np.concatenate([g, np.ones_like(u)], axis=1))
        return _h(_h(_direct(name, one)) * u)
    if name == "swigluoai_uninterleave":
        gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
        return _h(_f(_h(gc * _sig(1.702 * gc)) * _f(uc + 1.0)))
    return _h(_direct(name, x))  # one rounding: swigluoai, situ, swiglustep, *_no_mul


def _x(n1, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(64, n1, generator=g, dtype=F64) * scale).clamp(-12, 12)


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_exact_matches_direct_formula(name):
    x = _x(16, 1)
    got = apply_activation(x, name)
    assert got.dtype == F64 and got.shape == (64, output_width(name, 16))
    torch.testing.assert_close(got, torch.from_numpy(_direct(name, x)), **F64_TOL)


@pytest.mark.parametrize("name", SUPPORTED_ACTIVATIONS)
def test_fp16_rounding_emulation(name):
    x = rnd(_x(16, 2), torch.float16)  # the caller passes dt-representable inputs
    got = apply_activation(x, name, torch.float16)
    want = torch.from_numpy(_emulated(name, x))
    # transcendental functions: torch and numpy may differ in the last float64 bit, which can flip
    # an fp16 rounding only when the exact value sits on an fp16 tie (measure zero) -> bitwise here
    assert torch.equal(got, want)


def test_act_then_mul_rounds_the_activation_first():
    x = rnd(_x(64, 3), torch.float16)
    two_roundings = apply_activation(x, "silu", torch.float16)
    one_rounding = rnd(apply_activation(x, "silu"), torch.float16)
    assert not torch.equal(two_roundings, one_rounding)  # the intermediate rounding is observable


def test_swigluoai_is_interleaved_and_uninterleave_is_split():
    x = _x(8, 4)
    inter = apply_activation(x, "swigluoai")
    split = torch.cat([x[:, 0::2], x[:, 1::2]], dim=1)
    torch.testing.assert_close(apply_activation(split, "swigluoai_uninterleave"), inter, **F64_TOL)
    assert lookup_activation("swigluoai").interleaved and not lookup_activation("swigluoai_uninterleave").interleaved


def test_situ_linear_beta_unset_passes_up_through():
    x = _x(8, 5)
    g, u = x[:, :4], x[:, 4:]
    want = 2.0 * torch.tanh(g / 2.0) * torch.sigmoid(g) * u
    for lb in (None, -1.0):
        got = apply_activation(x, "situ", situ_beta=2.0, situ_linear_beta=lb)
        torch.testing.assert_close(got, want, **F64_TOL)


def test_names_aliases_and_widths():
    assert set(ACTIVATIONS) - set(SUPPORTED_ACTIVATIONS) == {"relu2"}
    assert is_gated("relu2") and not is_gated("relu2_no_mul") and is_gated("gelu_pytorch_tanh")
    x = _x(8, 6)
    torch.testing.assert_close(apply_activation(x, "gelu_pytorch_tanh"), apply_activation(x, "gelu_tanh"),
                               rtol=0, atol=0)
    assert output_width("silu", 10) == 5 and output_width("silu_no_mul", 10) == 10
    with pytest.raises(ValueError, match="supported activations: silu"):
        apply_activation(x, "relu2")
    with pytest.raises(ValueError, match="is unknown"):
        apply_activation(x, "swish")
    with pytest.raises(ValueError, match="n1 must be even"):
        output_width("gelu", 7)
    with pytest.raises(ValueError, match="x must have an even last dimension"):
        apply_activation(_x(7, 7), "silu")
    with pytest.raises(TypeError, match="x must be"):
        apply_activation(torch.ones(2, 4, dtype=torch.int64), "silu")


def test_activation_scale_act_and_mul_formula():
    x = _x(8, 8)
    xs = _x(8, 9).abs() * 1e-3
    g, u = x[:, :4], x[:, 4:]
    sg, su = xs[:, :4], xs[:, 4:]
    s = torch.sigmoid(g)
    f, df = g * s, s * (1 + g * (1 - s))
    want = df.abs() * sg * u.abs() + f.abs() * su + (f * u).abs()
    torch.testing.assert_close(activation_scale(x, xs, "silu"), want, **F64_TOL)
    r = torch.relu(x)
    torch.testing.assert_close(activation_scale(x, xs, "relu2_no_mul"), 2 * r * xs + r**2, **F64_TOL)


@pytest.mark.parametrize("name", ["swigluoai", "situ", "gelu", "swiglustep"])
def test_activation_scale_bounds_a_small_perturbation(name):
    x = _x(8, 10, scale=2.0)
    xs = torch.full_like(x, 1e-6)
    delta = xs * torch.sign(torch.randn(x.shape, generator=torch.Generator().manual_seed(11), dtype=F64))
    change = (apply_activation(x + delta, name) - apply_activation(x, name)).abs()
    bound = activation_scale(x, xs, name) - apply_activation(x, name).abs()  # the first-order part
    # first order: |change| <= bound + O(xs^2); xs^2 = 1e-12 times second derivatives of order 10
    assert bool((change <= bound + 1e-10).all())
    assert bool((bound > 0).any())


@pytest.mark.parametrize("name", sorted(CURVATURE))
def test_activation_remainder_bounds_what_the_first_order_leaves_out(name):
    """|h(x + e) - h(x) - h'(x) e| <= CURVATURE c e^2 at every x and |e| (crossing relu2's kink included), and c is
    tight: half the largest |h''|, reached within 2 % somewhere on the grid."""
    x = torch.linspace(-12.0, 12.0, 4801, dtype=F64)[:, None]
    e = torch.tensor([1e-3, 1e-2, 0.1, 0.5, 1.0, 3.0], dtype=F64)[None, :]
    h, dh = activation_derivatives(x, name)
    for sign in (1.0, -1.0):
        rest = (apply_activation(x + sign * e, name) - h - dh * sign * e).abs()
        assert bool((rest <= activation_remainder(e.expand_as(rest), name) * (1 + 1e-9) + 1e-12).all()), name
    small = e[:, :1]       # e -> 0: the remainder approaches |h''| e^2 / 2
    rest = (apply_activation(x + small, name) + apply_activation(x - small, name) - 2 * h) / 2
    assert float(rest.abs().max()) >= 0.98 * float(activation_remainder(small, name).max()), name
    assert activation_remainder(small, "silu") is None         # a gated form has none (CURVATURE's reason)


def test_activation_scale_rejects_bad_scale():
    x = _x(8, 12)
    with pytest.raises(ValueError, match="xscale must have the shape"):
        activation_scale(x, x[:, :4].abs(), "silu")
    with pytest.raises(ValueError, match=">= 0"):
        activation_scale(x, -x.abs(), "silu")


# f(g) of the gated activations (and silu_no_mul's) in float64 and as an fp32 kernel evaluates it: g sigmoid(g) and
# g / (1 + exp(-g)) (exp overflows past g < -88.7); the up factor m at u = 1.5, within every clamp
_FACTORS = {
    "silu": (lambda g: g * torch.sigmoid(g), lambda g: [g * torch.sigmoid(g), g / (1 + torch.exp(-g))], 1.5),
    "silu_no_mul": (lambda g: g * torch.sigmoid(g), lambda g: [g * torch.sigmoid(g), g / (1 + torch.exp(-g))], 1.0),
    "swigluoai": (lambda g: g * torch.sigmoid(1.702 * g),
                  lambda g: [g * torch.sigmoid(1.702 * g), g / (1 + torch.exp(-1.702 * g))], 2.5),
    "situ": (lambda g: 4 * torch.tanh(g / 4) * torch.sigmoid(g), lambda g: [4 * torch.tanh(g / 4) * torch.sigmoid(g)],
             25 * math.tanh(1.5 / 25)),
}


def _dense_flush(x, name):
    """activation_flush's (index, values) as a dense (M, I) tensor."""
    idx, lost = activation_flush(x, name)
    out = torch.zeros(x.shape[0], output_width(name, x.shape[1]), dtype=F64)
    out[idx] = lost
    return out


@pytest.mark.parametrize("name", list(_FACTORS))
def test_activation_flush_covers_fp32_evaluations_where_a_factor_leaves_the_normal_range(name):
    """fp32 evaluations a correct kernel uses differ from the exact value by at most their roundings plus
    activation_flush; the flush is what covers g << 0 (it is needed: silu's fp32 result there is 0 against -2e-37)."""
    exact_f, fp32_f, m = _FACTORS[name]
    g = torch.linspace(-300.0, 0.0, 6001).to(F64)     # fp32 values: the kernel's inputs
    x = torch.stack([g, torch.full_like(g, 1.5)], dim=1) if is_gated(name) else g[:, None]
    exact = apply_activation(x, name)[:, 0]
    torch.testing.assert_close(exact, exact_f(g) * m, rtol=1e-12, atol=0.0)
    flush = _dense_flush(x, name)[:, 0]
    # f's own fp32 error (a few ulps), its argument's rounding (alpha g, or g log2(e) inside exp: an ulp of g through
    # dh/dg, which the error model carries as the input's), the product with m; subnormal results to 2^-149
    dh_dg = activation_derivatives(x, name)[1][:, 0]
    own = 8 * 2.0 ** -24 * (exact.abs() + (g * dh_dg).abs()) + 2.0 ** -149 * (1 + m)
    for f32 in fp32_f(g.to(torch.float32)):
        err = (f32.to(F64) * m - exact).abs()
        assert bool((err <= own + flush).all()), float((err - own - flush).max())
        assert bool((err > own).any()), "no evaluation lost a value: the flush term is not exercised"


def test_activation_flush_is_zero_wherever_the_factor_is_normal():
    """The allowance takes nothing where sigmoid(g) is a normal fp32 number (g >= -87.3): silu(-80) = -1.4e-33 lost
    by a kernel has no cover, and a flushed value is under 2^-126 of its argument."""
    g = torch.tensor([-80.0, -87.0, -87.4, -89.0, -200.0], dtype=F64)
    flush = _dense_flush(torch.stack([g, torch.ones_like(g)], dim=1), "silu")[:, 0]
    assert flush[:2].tolist() == [0.0, 0.0]
    assert bool((flush[2:] > 0).all()) and bool((flush <= FP32_NORMAL_MIN * g.abs()).all())


def test_activation_flush_is_the_same_in_any_number_of_row_blocks(monkeypatch):
    """The flush is computed FLUSH_ROWS rows at a time (a served layer's activation is gigabytes in float64): the
    blocks change nothing."""
    import moe_lora_harness.reference.activations as acts
    g = torch.linspace(-120.0, 5.0, 300, dtype=F64).reshape(50, 6)
    x = torch.cat([g, torch.full_like(g, 0.7)], dim=1)
    whole = _dense_flush(x, "silu")
    monkeypatch.setattr(acts, "FLUSH_ROWS", 7)
    assert torch.equal(_dense_flush(x, "silu"), whole) and bool((whole > 0).any())
