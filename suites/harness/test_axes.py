"""The axis and profile tables (harness/draw/axes.py, harness/draw/profiles.py): the size classes hold their members, every
axis sets a case back to Case's defaults, the activation turns cover the registry, the statuses are listed once."""
from __future__ import annotations

import dataclasses

import pytest

from moe_lora_harness.harness.draw import axes as A
from moe_lora_harness.harness.spec.case import MAPPINGS, Case
from moe_lora_harness.harness.draw.profiles import CPU_DRAWS, GPU_DRAWS, LARGE, SMALL, draw_sizes, selftest_draw_sizes
from moe_lora_harness.harness.execution.runner import STATUSES
from moe_lora_harness.harness.search.signatures import PLAIN, axes_of
from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS


def test_every_member_of_a_size_class_is_in_it_and_in_no_earlier_one():
    for label, members in A.dim_members(A.PALETTE_DIMS):
        assert members and all(A.dim_class(m, A.PALETTE_DIMS) == label for m in members), label
    assert not any(A.dim_class(d, A.PALETTE_DIMS + ("unaligned",)) == "aligned64" for d in A.AWKWARD_DIMS)


@pytest.mark.parametrize("n, fine, signature", [
    (64, "aligned64", "aligned64"), (1024, "aligned64", "aligned64"), (48, "mult16", "mult8"), (40, "mult8", "mult8"),
    (37, "odd", "unaligned"), (7, "odd", "unaligned"), (6, "unaligned", "unaligned"), (12, "unaligned", "unaligned")])
def test_a_size_is_in_the_first_class_told_apart_that_holds(n, fine, signature):
    """A signature tells fewer classes apart than the pairwise rows: a multiple of 16 is then in mult8, an odd
    size unaligned (the partition the signatures always had: multiples of 64, of 8, the rest)."""
    assert A.dim_class(n) == fine and A.dim_class(n, A.SIGNATURE_DIMS) == signature
    assert A.dim_class(7, A.PALETTE_DIMS) == "tiny" and A.dim_class(2, A.PALETTE_DIMS) == "tiny"


def test_each_axis_sets_a_case_back_to_the_defaults_and_a_plain_case_is_its_own_plain():
    for level in ("op", "expert"):
        plain = Case(level=level)
        for name, a in A.AXES.items():
            if level in a.levels and a.plain is not None:
                assert a.plain(plain) == plain, name
    off = Case(T=40, top_k=5, E=8, max_rank=32, ranks=(1, 32), mapping="mixed", routing="skewed", shared_a=True,
               which="w2", num_slices=1, mul_routed_weight=True, offset=3, add_inputs=False, H=40, I=24,
               layout="sorted", block_size_m=32, active_loras="unique")
    for name, value in axes_of(off).items():
        a = A.AXES[name]
        if a.plain is None or PLAIN["op"][name] == value:
            continue
        flipped = a.plain(off)
        if flipped == off:      # implied by another axis (w2 has one slice): needed_axes skips it
            assert name == "slices"
            continue
        if name in ("K", "N"):  # on w2, K is I and N is H: set back to the plain I / H, of another class than w13's
            assert flipped == off.replace(**{"K": dict(I=Case().I), "N": dict(H=Case().H)}[name])
            continue
        assert axes_of(flipped)[name] == PLAIN["op"][name], (name, axes_of(flipped)[name])


def test_the_activation_turns_are_the_registry_s():
    assert set(A.GATED_TURNS) | set(A.NON_GATED_TURNS) | {"swigluoai"} == set(SUPPORTED_ACTIVATIONS)
    assert len(A.GATED_TURNS) + len(A.NON_GATED_TURNS) + 1 == len(SUPPORTED_ACTIVATIONS)


def test_the_mapping_lists_are_case_s():
    assert set(A.SINGLE_RANK_MAPPINGS) | {"by_rank"} == set(MAPPINGS)
    assert set(A.DISPATCHED_MAPPINGS) <= set(MAPPINGS)


def test_profiles_keep_the_cpu_sizes_and_one_gpu_set():
    assert draw_sizes("cpu", "op") == dict(max_T=12, max_dim=96) and draw_sizes("cpu", "expert")["max_T"] == 10
    assert selftest_draw_sizes("cpu") == dict(max_T=10, max_dim=64)
    assert {draw_sizes("cuda:0", lv)["max_T"] for lv in CPU_DRAWS} == {GPU_DRAWS.max_T}
    assert selftest_draw_sizes("cuda") == draw_sizes("cuda", "op")
    assert SMALL.small and not LARGE.small and dataclasses.replace(SMALL, small=False) != LARGE


def test_statuses_are_the_outcome_statuses_worst_first():
    assert STATUSES[:2] == ("fail", "xpass") and set(STATUSES) == {"pass", "fail", "unsupported", "xfail", "xpass",
                                                                   "works-unclaimed", "not-runnable"}
