"""Compile classes (harness/draw/compile_classes.py) and the planted shape-class bugs (harness/selftest/reach_mutants.py):
a palette meets every pair of values its backend can claim and says which it cannot; its classes are
claimed, well formed and balanced; a classed draw stays inside its class (so a GPU campaign reuses the
kernel cache) yet still reaches block edges, wide routing, many experts and large inputs; free draws are
untouched; each planted shape-class bug fails exactly where its class shows."""
from __future__ import annotations

import collections
import itertools

import pytest

from moe_lora_harness.harness.draw import compile_classes as CC
from moe_lora_harness.harness.draw import strategies as S
from moe_lora_harness.harness.spec.case import FP8_QUANTS, Case
from moe_lora_harness.harness.spec.contract import support_for
from moe_lora_harness.harness.draw.covering import _pairs
from moe_lora_harness.harness.draw.profiles import draw_sizes
from moe_lora_harness.harness.spec.registry import available_backends

PROFILES = {device: draw_sizes(device, "op") for device in ("cpu", "cuda")}   # the op palettes' size profiles
BACKENDS = [("triton", "op"), ("triton_small_batch", "op"), ("eager", "expert"), ("gated_fast_experts", "expert"),
            ("marlin_experts", "expert")]


@pytest.fixture(scope="module")
def backends():
    return available_backends()


def _realised(c: CC.CompileClass, level: str, **runtime) -> Case:
    f = dict(c.fields, level=level, T=c.tokens[0], E=max(4, c.fields["top_k"]), seed=0)
    return Case(**dict(f, **runtime))


# the GPU's palettes (their draws only, no kernel) in the full tier on a CPU run
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name,level", BACKENDS)
def test_a_palette_meets_every_pair_it_can_claim_and_only_claimed_classes(backends, name, level, device):
    spec = backends[name]
    p = CC.palette_for(spec, device, level, **PROFILES[device])
    if not p.classes:    # nothing claimable here: every pair is then unmet, said so
        assert set(_pairs(p.axes)) <= set(p.unmet)
        return
    held = CC.value_pairs(p)
    for pair in _pairs(p.axes):
        assert (pair in held) != (pair in p.unmet), pair     # met, or listed as unmet: never both, never neither
    for c in p.classes:
        case = _realised(c, level)
        assert not case.problems(), (c.describe(), case.problems())
        assert support_for(spec, case, device)[0], (c.describe(), support_for(spec, case, device))
    plainness = [sum(ax.values.index(dict(c.labels)[ax.name]) for ax in p.axes) for c in p.classes]
    assert plainness[0] == min(plainness)      # shrinking (to class 0) goes to the plainest class


def test_unmet_pairs_are_the_declared_limits_both_ways(backends):
    """The triton op under the interpreter: exactly the naive layout past 33 tokens (too slow there) and w2
    without the routed weight (no such vLLM call); on a GPU only the latter. small_batch (rank <= 64): every
    pair with a rank past 64 is unmet; gated_fast (I % 128): no class with an odd I."""
    want = {(("shape", "w2"), ("mul", False)), (("layout", "naive"), ("tokens", "edge64")),
            (("layout", "naive"), ("tokens", "edge128"))}
    assert set(CC.palette_for(backends["triton"], "cpu", "op", **PROFILES["cpu"]).unmet) == want
    assert set(CC.palette_for(backends["triton"], "cuda", "op", **PROFILES["cuda"]).unmet) == {(("shape", "w2"), ("mul", False))}
    sb = CC.palette_for(backends["triton_small_batch"], "cuda", "op", **PROFILES["cuda"])
    assert all(pair in sb.unmet for pair in _pairs(sb.axes) if ("rank", "past64") in pair)
    assert all(c.fields["max_rank"] <= 64 for c in sb.classes)
    gf = CC.palette_for(backends["gated_fast_experts"], "cuda", "expert", **PROFILES["cuda"])
    assert gf.classes and all(c.fields["I"] % 128 == 0 for c in gf.classes)


def test_palettes_are_small_and_balanced(backends):
    """About the pairwise lower bound of classes, and every value of an axis about equally often (so a
    campaign meets each pair in several classes, as often as a free draw would)."""
    for name, level in (("triton", "op"), ("triton_experts", "expert")):
        p = CC.palette_for(backends[name], "cuda", level, **PROFILES["cuda"])
        sizes = sorted((len(ax.values) for ax in p.axes), reverse=True)
        assert sizes[0] * sizes[1] <= len(p.classes) <= 2 * sizes[0] * sizes[1], len(p.classes)
        for ax in p.axes:
            n = collections.Counter(dict(c.labels)[ax.name] for c in p.classes)
            assert min(n.get(v, 0) for v in ax.values) >= 0.5 * len(p.classes) / len(ax.values), (ax.name, n)


@pytest.mark.parametrize("name,level", [("triton", "op"), ("triton_experts", "expert")])
def test_a_classed_draw_stays_in_its_class_and_still_reaches(backends, name, level):
    spec = backends[name]
    sizes = PROFILES["cuda"]
    p = CC.palette_of(spec, "cuda", level, **sizes)
    cases = S.examples(S.claimed_cases(spec, "cuda", level, compile_classes=True, **sizes), 300)
    assert all(not c.problems() and support_for(spec, c, "cuda")[0] for c in cases)
    fp8 = [c for c in cases if c.quant in FP8_QUANTS]    # free-shaped even here (strategies.claimed_cases says why)
    assert bool(fp8) == (level == "expert" and bool(set(FP8_QUANTS) & spec.capabilities.quant))
    cases = [c for c in cases if c.quant not in FP8_QUANTS]
    classes = [CC.class_of(c, p) for c in cases]
    assert all(k is not None for k in classes), [c.to_json() for c, k in zip(cases, classes) if k is None][:2]
    assert len({k.describe() for k in classes}) <= len(p.classes)
    assert sum(c.T > 16 for c in cases) >= 50 and any(c.top_k >= 5 for c in cases) and any(c.E >= 32 for c in cases)
    assert any(c.magnitude > 1 for c in cases) and any(c.outliers for c in cases)
    if level == "op":
        assert any(c.ep_size > 1 for c in cases) and any(c.offset for c in cases) and any(c.fully_sharded for c in cases)
    else:
        assert any(c.dispatched for c in cases) and any(c.tp_size > 1 for c in cases)
        acts = {(dict(k.labels)["activation"], dict(k.labels)["dtype"]) for k in p.classes}
        assert acts == set(itertools.product(p.axes[1].values, p.axes[0].values))   # every activation x dtype


def test_classed_dispatched_ep_draws_stay_in_their_class_at_most_65_tokens(backends):
    spec = backends["triton_experts"]
    p = CC.palette_of(spec, "cuda", "expert", **PROFILES["cuda"])
    cases = S.examples(S.claimed_cases(spec, "cuda", "ep", compile_classes=True, **PROFILES["cuda"]), 120)
    assert cases and all(c.dispatched and c.T <= S.EP_MOST_TOKENS and sum(c.ep_tokens) == c.T for c in cases)
    assert all(CC.class_of(c, p) is not None for c in cases)
    assert any(c.T in (63, 64, 65) for c in cases) and any(0 in c.ep_tokens for c in cases)


def test_free_draws_are_the_default_and_the_palette_choice_is_checked():
    assert S.wants_compile_classes("auto", "cuda:0") and not S.wants_compile_classes("auto", "cpu")
    assert S.wants_compile_classes("classes", "cpu") and not S.wants_compile_classes("free", "cuda")
    with pytest.raises(ValueError, match="palette must be one of"):
        S.wants_compile_classes("fast", "cuda")


def test_fuzz_cli_runs_with_compile_classes_on_cpu(tmp_path):
    from moe_lora_harness.harness.front import cli
    rc = cli.main(["fuzz", "--only", "eager", "--level", "op", "--device", "cpu", "--palette", "classes",
                   "--max-examples", "4", "--in-process", "--no-db", "-q", "--out", str(tmp_path)])
    assert rc == 0
    import json
    assert "compile classes" in json.loads((tmp_path / "campaign.json").read_text())["shapes"]


# -- planted shape-class bugs ----------------------------------------------------------------------------------

def _op(**kw):
    base = dict(level="op", T=6, H=32, I=32, E=4, top_k=2, max_loras=2, max_rank=8, dtype="float32",
                mapping="uniform", which="w13", num_slices=2, add_inputs=True, layout="sorted", seed=3)
    return Case(**dict(base, **kw))


# where each defect shows, and a case just outside its class (the planted bug must pass there)
SHOWS = {
    "tokens-past-16": (_op(T=17), _op(T=16)),
    "k-tail": (_op(H=30), _op(H=32)),
    "rank-1": (_op(max_rank=1), _op(max_rank=2)),
    "top-k-past-4": (_op(top_k=5, E=6), _op(top_k=4, E=6)),
    "n-tail-past-32": (_op(I=40), _op(I=64)),
    "slice-2-without-add-inputs": (_op(add_inputs=False), _op(add_inputs=False, num_slices=1)),
    "subnormal-flush": (_op(dtype="float16", magnitude=2.0 ** -20, num_slices=1),
                        _op(dtype="float32", magnitude=2.0 ** -20, num_slices=1)),
}


@pytest.fixture(scope="module")
def reach():
    from moe_lora_harness.harness.selftest.reach_mutants import DEFECTS, REACH_MUTANTS
    assert set(SHOWS) == set(DEFECTS)
    return {s.name: s for s in REACH_MUTANTS}, DEFECTS


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_each_planted_shape_bug_fails_in_its_class_and_only_there(reach, name, device):
    from moe_lora_harness.harness.execution.execute import InProcess
    from moe_lora_harness.harness.execution.runner import run_case
    specs, defects = reach
    inside, outside = SHOWS[name]
    shows = defects[name][1]
    assert shows(inside) and not shows(outside)
    ex = InProcess()
    assert run_case(specs[f"reach-{name}"], inside, device, executor=ex, reruns=0).failed
    assert run_case(specs[f"reach-{name}"], outside, device, executor=ex, reruns=0).status == "pass"
    assert run_case(specs["reach-control"], inside, device, executor=ex, reruns=0).status == "pass"
