"""Gradual underflow in the error model: a correct kernel whose values go subnormal passes, a flush-to-zero
kernel fails, and the allowance is what makes the difference (checked both ways)."""
from __future__ import annotations

import pytest
import torch

from moe_lora_harness.harness.build.builders import torch_dtype
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.judge.compare import compare_written, tiny
from moe_lora_harness.harness.execution.execute import InProcess
from moe_lora_harness.harness.spec.registry import available_backends
from moe_lora_harness.harness.judge.expectation import judging
from moe_lora_harness.harness.execution.runner import expectations, run_case

EAGER = available_backends()["eager"]
# float16 op cases whose deltas are subnormal: hidden states at 2^-20, or a delta written alone
TINY_OP = [Case(T=6, H=48, I=40, E=4, top_k=2, max_loras=3, max_rank=8, seed=7, dtype="float16",
                magnitude=2.0 ** -20, add_inputs=False),
           Case(T=9, H=64, I=24, E=3, top_k=2, max_loras=2, max_rank=4, seed=11, dtype="float16", which="w2",
                num_slices=1, mul_routed_weight=True, magnitude=2.0 ** -20, add_inputs=False, layout="naive"),
           # found by fuzzing eager at GPU sizes: one B column ~1e-6 made its deltas subnormal (magnitude 1)
           Case(H=128, I=7, T=31, add_inputs=False, block_size_m=64, max_loras=1, max_rank=1, mul_routed_weight=True,
                num_slices=1, offset=3, seed=878826, top_k=4, which="w2")]
TINY_EXPERT = [Case(level="expert", T=5, H=32, I=32, E=4, top_k=2, max_loras=2, max_rank=8, seed=7,
                    dtype="float16", magnitude=2.0 ** -20),
               Case(level="expert", T=5, H=32, I=48, E=4, top_k=1, lora=False, seed=3, dtype="float16",
                    activation="gelu", magnitude=2.0 ** -20)]


def _verdicts(spec, case, device):
    """(verdict with the underflow allowance, verdict without it) of `spec`'s output on `case`."""
    exp = expectations(spec, case, device)
    ex = InProcess().execute(spec, case, device, exp.poison)
    assert ex.failure is None, ex.failure
    written, kr, _ = judging(case, exp.truth)
    args = (ex.output, exp.truth.value, exp.emulation.value, exp.truth.scale, written)
    kw = dict(dtype=torch_dtype(case), k_plus_r=kr, before=exp.before)
    return (compare_written(*args, **kw, underflow=exp.truth.underflow, work_dtype=torch_dtype(case)),
            compare_written(*args, **kw))


def _correct(case):
    """The correct kernel: eager at the op level; at the expert level triton_experts, the class the oracle
    picks for these cases (a silu I % 128 != 0 and a gelu case), which the oracle leaves to it on the CPU."""
    return EAGER if case.level == "op" else available_backends()["triton_experts"]


@pytest.mark.parametrize("case", TINY_OP + TINY_EXPERT, ids=lambda c: c.id)
def test_correct_kernel_passes_where_values_go_subnormal(case, device):
    out = run_case(_correct(case), case, device)
    assert out.status == "pass", out.detail


@pytest.mark.parametrize("case", TINY_OP + TINY_EXPERT, ids=lambda c: c.id)
def test_the_allowance_is_what_passes_them(case, device):
    """Without the underflow term these correct outputs fail per element on the CPU, where the cases were found: the
    term is needed, not decoration. (On a GPU the same kernels may round where nothing underflows, e.g. eager's w2
    delta kept in fp32 by its GEMM until the add: the term is then unused, and only the passing verdict is claimed.)"""
    with_allowance, without = _verdicts(_correct(case), case, device)
    assert with_allowance.ok, with_allowance.message
    if device == "cpu":
        assert not without.ok and without.kind == "element", without.summary()


@pytest.mark.parametrize("case", TINY_OP[:2], ids=lambda c: c.id)
def test_flush_to_zero_still_fails(case, device):
    from moe_lora_harness.harness.selftest.reach_mutants import REACH_MUTANTS
    ftz = next(s for s in REACH_MUTANTS if s.name == "reach-subnormal-flush")
    out = run_case(ftz, case, device, reruns=0)
    assert out.status == "fail" and out.kind in ("element", "aggregate"), (out.status, out.reason)


@pytest.mark.parametrize("case", [Case(T=8, H=64, I=32, E=4, top_k=2, max_loras=2, max_rank=16, seed=5, dtype="float16"),
                                  Case(level="expert", T=5, H=32, I=32, E=4, top_k=2, max_loras=2, max_rank=8, seed=7,
                                       dtype="float16")], ids=lambda c: c.id)
def test_exposure_counts_every_rounding_and_stays_far_below_an_ulp_at_normal_values(case):
    """Every written element carries an exposure >= 2 (at least two roundings produce it), and at normal
    magnitudes the allowance is far below one ulp of the values (it cannot hide a real error there)."""
    exp = expectations(_correct(case), case, "cpu")
    written = judging(case, exp.truth)[0]
    u = exp.truth.underflow[written]
    assert bool((u >= 2).all())
    allowance = tiny(torch.float16) * u
    ulp = torch.finfo(torch.float16).eps * exp.truth.scale[written]
    assert float((allowance / ulp).max()) < 0.01


# fp32 expert cases whose pre-activations reach -89 and beyond (hidden states at 64, I of 1-2): silu's and
# swigluoai's sigmoid leaves fp32's normal range, where the fp32 evaluation returns 0 for values near -1e-37 that
# make up a row's whole output (found by random fp32 cases of short sums, forty-seventh session)
FLUSHED_ACTIVATION = [
    Case(level="expert", H=10, I=1, T=172, dtype="float32", magnitude=64.0, mapping="mixed", max_loras=4,
         max_rank=16, seed=123768, top_k=1),
    Case(level="expert", H=36, I=2, T=276, activation="swigluoai", dtype="float32", magnitude=64.0, mapping="mixed",
         max_loras=4, max_rank=16, seed=308530, shared_b=True, top_k=1, tp_size=2),
]


@pytest.mark.parametrize("case", FLUSHED_ACTIVATION, ids=lambda c: c.id)
def test_an_activation_factor_below_fp32s_normal_range_may_be_lost(case, device, monkeypatch):
    """eager's fp32 SiLU loses x sigmoid(x) where sigmoid(x) < 2^-126 (reference.activations.activation_flush):
    it passes, and without that term in the reference's underflow exposure it fails per element on the CPU."""
    out = run_case(EAGER, case, device)
    assert out.status == "pass", out.detail
    if device == "cpu":
        import moe_lora_harness.reference.experts as experts
        none = torch.zeros(0, dtype=torch.long)
        monkeypatch.setattr(experts, "activation_flush", lambda x, name: ((none, none), none.double()))
        with_allowance, _ = _verdicts(EAGER, case, device)
        assert not with_allowance.ok and with_allowance.kind == "element", with_allowance.summary()
