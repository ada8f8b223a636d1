"""Claimed vs actual for every expert backend: each one runs over a small grid of configs with probing.

A backend that claims a config and fails it fails the test; one that passes a config it declines is
reported (a UserWarning "works-unclaimed: ...", one per config; a builtin category so pytest-xdist can
carry it between processes), e.g. the gated fast path on I = 96 (its I % 128 rule is a
tiling choice, and its kernel masks the tail). A planted over-claiming backend shows the check can fail.
"""
from __future__ import annotations

import warnings

import pytest

from moe_lora_harness.backends import experts as B
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.execution.runner import run_case
from moe_lora_harness.kernels.experts.gated_fast_experts import GatedFastExperts


def _grid(device) -> list[Case]:
    dt = "bfloat16" if str(device).startswith("cuda") else "float16"
    base = dict(level="expert", T=4, H=64, E=4, top_k=2, max_loras=2, max_rank=8, dtype=dt, seed=7)
    rows = [dict(activation="silu", I=128), dict(activation="silu", I=96),
            dict(activation="relu2_no_mul", I=128), dict(activation="swigluoai", I=96, bias=True),
            dict(activation="silu", I=128, dtype="float32"), dict(activation="silu", I=128, quant="int8_channel"),
            dict(activation="silu", I=96, lora=False, ep_size=2, ep_rank=1, E=8),
            dict(activation="gelu", I=96, mapping="mixed")]
    return [Case(**dict(base, **r)) for r in rows]


def claim_report(spec, cases, device):
    """(failures, unclaimed, passes): claimed-and-failed details, works-unclaimed reasons, claimed passes."""
    failures, unclaimed, passes = [], [], 0
    for case in cases:
        out = run_case(spec, case, device, probe=True)
        if out.failed:
            failures.append(out.detail or f"{out.status}: {out.reason}")
        elif out.status == "works-unclaimed":
            unclaimed.append(f"{spec.name}: {out.reason}: {case.to_json()}")
        elif out.status == "pass":
            passes += 1
    return failures, unclaimed, passes


@pytest.mark.parametrize("spec", [B.TRITON_EXPERTS, B.GATED_FAST_EXPERTS, B.OAI_EXPERTS, B.MARLIN_EXPERTS,
                                  B.EXPERTS_ORACLE], ids=lambda s: s.name)
def test_claims_match_behaviour(spec, device):
    cases = _grid(device)
    failures, unclaimed, passes = claim_report(spec, cases, device)
    for line in unclaimed:
        warnings.warn(f"works-unclaimed: {line}", UserWarning)
    assert not failures, "claimed and failed:\n" + "\n\n".join(failures)
    assert passes >= 1, f"{spec.name} claimed no config of the grid: the check would be vacuous"


def test_fast_path_on_I_96_is_reported_as_works_unclaimed(device):
    case = _grid(device)[1]
    out = run_case(B.GATED_FAST_EXPERTS, case, device, probe=True)
    assert out.status == "works-unclaimed" and "I % 128 == 0" in out.reason, (out.status, out.reason)


def test_fast_path_refuses_a_non_gated_activation(device):
    case = _grid(device)[2]
    out = run_case(B.GATED_FAST_EXPERTS, case, device, probe=True)
    assert out.status == "unsupported", (out.status, out.reason)


class _OverclaimingFast(GatedFastExperts):
    """Planted: declares every activation (gated or not) but still computes gated silu-and-mul."""

    name = "overclaiming_fast"
    activations = frozenset({"silu", "relu2_no_mul", "gelu"})
    supports_non_gated = True

    def __init__(self, config):   # no refusal: the trap vLLM's early return fell into
        super(GatedFastExperts, self).__init__(config)


def test_planted_overclaim_fails_the_check(device):
    spec = B.spec_for(_OverclaimingFast, "planted over-claiming fast path")
    claimed = _grid(device)[0]   # silu, I = 128: inside the planted class's shape rule
    cases = [claimed.replace(activation="relu2_no_mul"), claimed.replace(activation="gelu")]
    failures, _, _ = claim_report(spec, cases, device)
    assert len(failures) == len(cases), failures
