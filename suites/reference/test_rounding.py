"""The emulation's rounding (reference.precision._round_elements, on float64's bits) against its definition through
the exponent, bit for bit: every format the reference rounds to, both directions, at every binade, at ties and next
to them, in each format's subnormals and float64's own, at overflow, and through NaN, infinities and signed zeros;
each of its implementations (NumPy's for a small CPU tensor, torch's for the rest: the same steps by name; casts
rounding to odd through float32, for float16 and bfloat16)."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.reference import fp8
from moe_lora_harness.reference.precision import (CAST_ROUND_MIN, NUMPY_ROUND_MAX, _CAST_DTYPES, _OPERAND_FORMATS,
                                                   _round_by_casts, _round_elements, _round_numpy, _round_steps)

F64 = torch.float64

# name -> (significant bits, min normal exponent, max finite[, toward zero]): every format the reference rounds to
# (its operand formats, e4m3), float16's range toward zero (the truncating branch where a normal range ends near 1,
# which tf32rz's does not) and float32's 24 bits (rnd takes float32 natively; the widest significand here)
FORMATS = {**_OPERAND_FORMATS, "e4m3": (fp8.E4M3_BITS, fp8.E4M3_EMIN, fp8.E4M3_MAX),
           "fp16rz": (*_OPERAND_FORMATS["fp16"], True), "fp32": (24, -126, float(torch.finfo(torch.float32).max))}


def _by_exponent(x, bits, emin, fmax, toward_zero):
    """The definition: a multiple of the unit of the value's binade (not below emin's), inf past fmax."""
    _, e = torch.frexp(x)
    unit = torch.pow(2.0, (e.to(F64) - 1).clamp_min(emin) - (bits - 1))     # exact on the CPU
    y = (torch.trunc(x / unit) if toward_zero else torch.round(x / unit)) * unit
    y = torch.where(y.abs() > fmax, torch.copysign(torch.full_like(y, float("inf")), x), y)
    return torch.where(torch.isfinite(x), y, x)


def _values(bits: int, emin: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(bits * 1000 - emin)
    patterns = torch.randint(-2 ** 63, 2 ** 63 - 1, (3000,), generator=g, dtype=torch.int64).view(F64)
    f64_subnormals = torch.randint(-2 ** 40, 2 ** 40, (300,), generator=g, dtype=torch.int64).view(F64)
    ints = torch.randint(0, 1 << bits + 1, (40,), generator=g).to(F64)
    near = []
    for shift in list(range(emin - bits - 3, emin + 4)) + list(range(-3, 20, 4)):   # subnormals, emin, normal
        for d in (0.5, 0.5 - 2.0 ** -30, 0.5 + 2.0 ** -30, 0.25, 1.0):   # ties, either side of them, on the grid
            v = (ints + d) * 2.0 ** (shift - bits)
            near += [v, -v]
    fixed = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 5e-324, -5e-324, 65504.0, 65519.0,
                          65520.0, 448.0, 464.0, 465.0, 480.0, 1e308, -1e308], dtype=F64)
    payloads = torch.tensor([0x7FF0000000000001, 0x7FFFFFFFE0000000, -0x0000000000000001], dtype=torch.int64)
    return torch.cat([patterns, f64_subnormals, torch.cat(near), fixed, payloads.view(F64)])   # NaNs with payloads


def assert_definition_bits(x, got, form, nan_bits=True):
    """`got`, x rounded to `form`, is the exponent definition's bits (a NaN's bits too; any NaN for a NaN where
    `nan_bits` is False); the first five misses named. The CPU's tests and the GPU's (test_judge_on_gpu) use it."""
    want = _by_exponent(x, *(*form, False)[:4])
    same = got.view(torch.int64) == want.view(torch.int64)
    if not nan_bits:
        same |= torch.isnan(got) & torch.isnan(want)
    assert bool(same.all()), [(x[i].item(), got[i].item(), want[i].item()) for i in (~same).nonzero().flatten()[:5]]


IMPLEMENTATIONS = {
    "numpy": _round_numpy,
    "torch": lambda x, *form: _round_steps(torch, x, *form),
    "dispatched": _round_elements,     # casts for float16 and bfloat16 (more values than CAST_ROUND_MIN), else NumPy
}


@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_rounding_on_the_bits_is_the_exponent_definition(fmt, impl):
    bits, emin, fmax, toward_zero = (*FORMATS[fmt], False)[:4]
    x = _values(bits, emin)
    assert CAST_ROUND_MIN < x.numel() <= NUMPY_ROUND_MAX
    got = IMPLEMENTATIONS[impl](x, bits, emin, fmax, toward_zero)
    assert_definition_bits(x, got, (bits, emin, fmax, toward_zero), nan_bits=False)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_rounding_by_casts_is_the_exponent_definition(fmt):
    """float16's and bfloat16's rounding by casts (round to odd through float32), at every binade, next to ties (the
    values a plain float64 -> float32 -> dt cast rounds twice), subnormals, overflow and non-finite values."""
    form = _OPERAND_FORMATS[fmt]
    x = _values(*form[:2])
    assert_definition_bits(x, _round_by_casts(x, _CAST_DTYPES[form]), form)     # a NaN passes through, its bits kept
    want = _by_exponent(x, *form, False)
    twice = x.to(torch.float32).to(_CAST_DTYPES[form]).to(F64)     # the plain cast: wrong next to some ties
    assert not bool(((twice.view(torch.int64) == want.view(torch.int64)) | torch.isnan(want)).all())


def test_a_strided_view_rounds_as_its_copy_below_and_above_the_numpy_size():
    for n in (300, NUMPY_ROUND_MAX // 64 + 1):       # 19,200 values (NumPy), then 65,600 (torch); casts for fp16, bf16
        x = torch.randn(64, n, generator=torch.Generator().manual_seed(1), dtype=F64).t() * 1e-3
        for form in FORMATS.values():
            assert torch.equal(_round_elements(x, *form), _round_elements(x.contiguous(), *form))
            assert torch.equal(_round_elements(x, *form), _round_steps(torch, x, *form))
