"""Reach: the cases go where kernels break (block edges, wide routing, sparse experts, awkward dims, inputs past
the activations' clamps, outlier tokens), and the pairwise covering rows of `check` meet every pair of values
of the risky axes. No kernel runs here: strategies are drawn, designs read back, inputs built."""
from __future__ import annotations

import hashlib
import itertools
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, settings

from moe_lora_harness.harness.build import builders
from moe_lora_harness.harness.draw import covering as C
from moe_lora_harness.harness.draw import strategies as S
from moe_lora_harness.harness.build.builders import OUTLIER_SCALE, build_expert_inputs, build_op_inputs, outlier_tokens
from moe_lora_harness.harness.spec.case import Case
from moe_lora_harness.harness.check.features import (EXPERT_FEATURES, FEATURES, OP_FEATURES, PAIRWISE_EXPERT_FEATURES,
                                               PAIRWISE_OP_FEATURES)
from moe_lora_harness.harness.draw.profiles import LARGE, SMALL, draw_sizes
from moe_lora_harness.reference.activations import OAI_LIMIT, SUPPORTED_ACTIVATIONS

_FIND = settings(max_examples=4000, derandomize=True, database=None, deadline=None, phases=(Phase.generate,),
                 suppress_health_check=list(HealthCheck))
_STRATEGIES = {"op": S.op_cases, "expert": S.expert_cases, "ep": S.ep_cases}


# -- the covering designs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cuda"])     # the small (interpreter) and large (GPU) size profiles
@pytest.mark.parametrize("level", ["op", "expert"])
def test_pairwise_rows_meet_every_valid_pair(level, device):
    """Read back from the check rows' own cases (not the abstract design): every pair of values of the axes
    meets in one of them, less the pairs that cannot meet (each with its reason) and, on the small profile,
    bf16 (the interpreter has none: those rows run in fp32, every other pair of theirs kept)."""
    feats = PAIRWISE_OP_FEATURES if level == "op" else PAIRWISE_EXPERT_FEATURES
    d = C.design(level)
    cases = [c for f in feats for c in f.cases(device, 2)]
    assert len(cases) == len(feats) == len(d.rows)          # one case per row, whatever n is
    assert all(not c.problems() for c in cases), [c.problems() for c in cases if c.problems()]
    classify = C.classify_op if level == "op" else C.classify_expert
    missing = C.uncovered_pairs(cases, d.axes, classify, d.excluded)
    if device == "cpu":
        missing = [p for p in missing if ("dtype", "bfloat16") not in p]
        assert not any(c.dtype == "bfloat16" for c in cases)
    assert not missing, f"pairs no {level} pairwise row meets: {missing}"
    for c in cases:   # and the rows realise only the axes' values (no "other" class)
        assert "other" not in classify(c).values(), (c.to_json(), classify(c))


@pytest.mark.parametrize("level", ["op", "expert"])
def test_pairwise_designs_are_small_and_say_which_pairs_they_skip(level):
    d = C.design(level)
    bound = C.lower_bound(d.axes)
    assert bound <= len(d.rows) <= bound + (1 if level == "op" else 3), (len(d.rows), bound)
    for (a, b), why in d.excluded.items():
        assert why, (a, b)
    if level == "op":
        assert d.excluded == {
            (("slices", 2), ("which", "w2")): "w2 has one output slice in vLLM (the H-wide down projection)",
            (("layout", "naive"), ("ep", "expert_map")): "naive block assignment is disabled under EP"}
        bad = Case(layout="naive", ep_size=2, E=8)
        assert any("naive" in p for p in bad.problems())
    else:
        assert d.excluded == {}
    # deterministic: the same rows again
    assert C.all_pairs(d.axes, d.excluded, lambda r: True,
                       seeds=C.OP_SEEDS if level == "op" else C.EXPERT_SEEDS) == list(d.rows)


def test_all_pairs_on_a_toy_space_with_a_forbidden_pair():
    axes = (C.DesignAxis("a", (0, 1, 2)), C.DesignAxis("b", ("x", "y")), C.DesignAxis("c", (True, False)))
    forbidden = {(("a", 2), ("b", "y")): "no"}
    rows = C.all_pairs(axes, forbidden, lambda r: True)
    seen = {p for r in rows for p in itertools.combinations(r.items(), 2)}
    want = {p for p in C._pairs(axes)} - set(forbidden)
    assert want <= seen and (("a", 2), ("b", "y")) not in seen


# -- new Case fields ----------------------------------------------------------------------------------------------

def test_magnitude_and_outliers_round_trip_and_default_away():
    c = Case(level="expert", T=9, magnitude=8.0, outliers=2, dtype="float32")
    assert json.loads(c.to_json())["magnitude"] == 8.0 and json.loads(c.to_json())["outliers"] == 2
    assert Case.from_json(c.to_json()) == c and not c.problems()
    assert Case().to_json() == "{}"                     # defaults never appear: old JSON, old ids
    assert Case(magnitude=1.0, outliers=0) == Case() and Case(magnitude=1.0).id == Case().id


@pytest.mark.parametrize("bad, needle", [
    (dict(magnitude=0.0), "magnitude"), (dict(magnitude=-2.0), "magnitude"),
    (dict(magnitude=float("inf")), "magnitude"),
    (dict(magnitude=1000.0), "magnitude"), (dict(magnitude="8"), "magnitude"), (dict(magnitude=True), "magnitude"),
    (dict(outliers=-1), "outliers"), (dict(outliers=5, T=4), "outliers"), (dict(outliers=1.5), "outliers"),
    (dict(level="expert", magnitude=2.0, outliers=1), "float16"),
])
def test_malformed_input_scale_is_named(bad, needle):
    probs = Case(**dict(dict(T=4), **bad)).problems()
    assert probs and any(needle in p for p in probs), probs


def test_fp16_bound_admits_what_the_strategies_and_features_draw():
    assert not Case(level="expert", T=4, outliers=2).problems()               # 30x at magnitude 1
    assert not Case(level="expert", T=4, magnitude=12.0).problems()
    assert not Case(level="expert", T=4, magnitude=4.0, outliers=2, dtype="float32").problems()
    assert not Case(T=4, magnitude=8.0, outliers=2).problems()                 # op level: linear, no bound


def _digest(ts) -> str:
    d = hashlib.sha1()
    for t in ts:
        if t is None:
            d.update(b"none")
            continue
        t = t.detach().contiguous()
        if t.is_floating_point():
            t = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        d.update(f"{tuple(t.shape)}{t.dtype}".encode())
        d.update(t.numpy().tobytes())
    return d.hexdigest()[:16]


# digests of the tensors harness.build.builders makes, computed before the input-scale fields existed
_GOLDEN_OP = {
    "{}": "f28e628c117e31e0",
    '{"H":40,"I":24,"T":17,"dtype":"float32","mul_routed_weight":true,"num_slices":1,"seed":5,"which":"w2"}':
        "bf36e3ec20fa2a95",
    '{"T":9,"layout":"naive","mapping":"mixed","max_loras":3,"ranks":[1,4,8],"seed":11}': "0e59cca2bbaace34",
}
_GOLDEN_EXPERT = {
    '{"level":"expert"}': "3de6e16df414e201",
    '{"T":17,"activation":"swigluoai","bias":true,"dtype":"float32","level":"expert","seed":3}': "8aa29304aa9f7b5c",
    '{"E":8,"T":6,"activation":"relu2_no_mul","ep_size":2,"ep_tokens":[2,4],"level":"expert","seed":7}':
        "cca309512ea0596c",
}


def _op_tensors(i):
    return [i.x, i.output, *i.lora_a, *i.lora_b, i.topk_weights, i.topk_ids, i.token_lora_mapping]


def _expert_tensors(i):
    return [i.hidden, i.w13, i.w2, i.w13_bias, i.w2_bias, i.topk_weights, i.topk_ids, i.token_lora_mapping]


def test_default_input_scale_leaves_existing_tensors_bit_identical(monkeypatch):
    """The tensors of cases at the default input scale, as built before the input scale existed. The -0.0
    planted in x, the output buffer and the hidden states (builders.with_negative_zeros, test_third_party) is
    turned off here: it is the only change since."""
    monkeypatch.setattr(builders, "NEGATIVE_ZERO_SHARE", 0)
    for js, want in _GOLDEN_OP.items():
        assert _digest(_op_tensors(build_op_inputs(Case.from_json(js)))) == want, js
    for js, want in _GOLDEN_EXPERT.items():
        assert _digest(_expert_tensors(build_expert_inputs(Case.from_json(js)))) == want, js


@pytest.mark.parametrize("mul", [False, True])
def test_input_scale_changes_only_the_hidden_states(mul, monkeypatch):
    """magnitude scales every token, outliers scale the chosen tokens' rows (w2: all k rows of a token) 30x
    more; at op level magnitude also scales the output buffer's prior values (so a delta stays about as large as
    what it is added to); every other tensor stays bit for bit. (No -0.0 planted here: x / x must be defined.)"""
    monkeypatch.setattr(builders, "NEGATIVE_ZERO_SHARE", 0)
    base = Case(T=9, top_k=2, dtype="float32", seed=4, **(dict(which="w2", num_slices=1, mul_routed_weight=True)
                                                            if mul else {}))
    scaled = base.replace(magnitude=4.0, outliers=2)
    a, b = build_op_inputs(base), build_op_inputs(scaled)
    assert _digest(_op_tensors(a)[2:]) == _digest(_op_tensors(b)[2:])
    assert torch.equal(b.output, a.output * 4.0)
    rows = a.x.shape[0] // base.T
    ratio = (b.x / a.x).reshape(base.T, rows, -1)
    hot = outlier_tokens(scaled).tolist()
    assert len(hot) == 2 and hot == outlier_tokens(scaled).tolist()    # deterministic from the seed
    for t in range(base.T):
        want = 4.0 * (OUTLIER_SCALE if t in hot else 1.0)
        torch.testing.assert_close(ratio[t], torch.full_like(ratio[t], want))
    e0 = Case(level="expert", T=7, seed=2, dtype="float32")
    e1, e2 = build_expert_inputs(e0), build_expert_inputs(e0.replace(magnitude=8.0))
    assert _digest(_expert_tensors(e1)[1:]) == _digest(_expert_tensors(e2)[1:])
    torch.testing.assert_close(e2.hidden, e1.hidden * 8.0)


def _swigluoai_pre_activation(case):
    from moe_lora_harness.reference.experts import LoRAInputs, moe_experts_forward
    from moe_lora_harness.reference.precision import precision
    inp = build_expert_inputs(case)
    r = moe_experts_forward(inp.hidden, inp.w13, inp.w2, inp.topk_weights, inp.topk_ids, activation=case.activation,
                            precision=precision("exact", None), w13_bias=inp.w13_bias, w2_bias=inp.w2_bias,
                            lora=LoRAInputs(inp.stacked, inp.token_lora_mapping) if inp.stacked else None,
                            return_intermediates=True)
    return r.cache1[..., 0::2], r.cache1[..., 1::2]        # swigluoai interleaves gate / up


def test_the_clamp_feature_drives_swigluoai_past_its_limit():
    """The check row's own case: a large share of the gate (and up) pre-activations pass swigluoai's limit 7, so
    the clamp is exercised; at magnitude 1 almost none do."""
    feat = next(f for f in EXPERT_FEATURES if f.name.startswith("experts: swigluoai at its clamp"))
    for case in feat.cases("cpu", 2):
        assert case.activation == "swigluoai" and case.magnitude >= 8
        gate, up = _swigluoai_pre_activation(case)
        assert (gate > OAI_LIMIT).double().mean() > 0.2, (gate > OAI_LIMIT).double().mean()
        assert (up.abs() > OAI_LIMIT).double().mean() > 0.2
        plain, _ = _swigluoai_pre_activation(case.replace(magnitude=1.0))
        assert (plain > OAI_LIMIT).double().mean() < 0.02


# -- strategies -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["op", "expert", "ep"])
def test_strategies_reach_block_edges_top_k_8_many_experts_and_large_inputs(name):
    strategy = _STRATEGIES[name]
    cases = S.examples(strategy(), 250)
    assert all(not c.problems() for c in cases)
    assert sum(c.T > 16 for c in cases) >= 5                     # on CPU sizes (max_T 10 / 12) ...
    assert sum(c.T <= 12 for c in cases) >= len(cases) // 2     # ... but not always: the average stays cheap
    assert any(c.top_k > 4 for c in cases) and any(c.E >= 32 for c in cases)
    assert any(c.magnitude > OAI_LIMIT for c in cases) and any(c.outliers for c in cases)
    if name != "ep":
        assert any(c.H % 16 and c.H % 8 == 0 for c in cases)
        # one dim off a 64-wide tile's edge: rarer than the sample's size guarantees, so searched for
        assert find(strategy(), lambda c: c.H in (63, 65) or c.I in (63, 65), settings=_FIND)
    assert set(S.REGIMES) == {"base", "boundary", "wide", "many"}
    # each regime (all of them drawn by default) reaches its axis: every block-edge count 15/16/17 ... 127/128/129
    # (dispatched EP: up to 65, as every rank runs), top_k 8 with E >= 8, E up to 64 with a handful of tokens
    want = {t for t in S.BOUNDARY_TOKENS if name != "ep" or t <= 65}
    edge = strategy(regimes=("boundary",))
    for t in sorted(want - {c.T for c in S.examples(edge, 200)}):        # the rarer ones searched for
        assert find(edge, lambda c, t=t: c.T == t, settings=_FIND).T == t
    wide = S.examples(strategy(regimes=("wide",)), 60)
    assert any(c.top_k == 8 for c in wide) and all(c.E >= c.top_k >= 5 for c in wide)
    many = S.examples(strategy(regimes=("many",)), 60)
    assert any(c.E == 64 for c in many) and all(c.E >= 32 and c.T <= 12 for c in many)


def test_expert_strategy_reaches_every_activation_in_every_dtype():
    dtypes = ("float16", "float32", "bfloat16")
    seen = {(c.activation, c.dtype) for c in S.examples(S.expert_cases(dtypes=dtypes, regimes=("base",)), 500)}
    want = set(itertools.product(SUPPORTED_ACTIVATIONS, dtypes))
    for act, dt in sorted(want - seen):
        assert find(S.expert_cases(dtypes=dtypes), lambda c: (c.activation, c.dtype) == (act, dt), settings=_FIND)


def test_claimed_cases_of_a_triton_backend_reach_past_sixteen_tokens():
    from moe_lora_harness.harness.spec.registry import available_backends
    spec = available_backends()["triton"]
    case = find(S.claimed_cases(spec, "cpu", "op", **draw_sizes("cpu", "op")), lambda c: c.T > 16 and c.top_k >= 1,
                settings=_FIND)
    assert case.T in S.BOUNDARY_TOKENS


# -- check rows -------------------------------------------------------------------------------------------------

def test_check_rows_reach_the_axes():
    names = {f.name for f in FEATURES}
    assert len(names) == len(FEATURES)                           # ids stay unique
    cpu = [c for f in FEATURES for c in f.cases("cpu", 2)]
    assert 17 in {c.T for c in cpu if c.level == "expert"} and {17, 33} <= {c.T for c in cpu if c.level == "op"}
    assert any(c.top_k == 8 and c.E == 16 for c in cpu if c.level == "expert")
    assert any(c.E == 64 and c.T == 5 for c in cpu if c.level == "expert")
    # found by planted source mutants (bench/mutation_score.py): a grid whose first block is its last, and a K loop
    # that advances (a CPU's K tile is 128 from K = 128: only a K over 128 takes a second tile)
    assert {"op", "expert"} <= {c.level for c in cpu if c.T == 1 and c.top_k == 1}
    assert any(c.K > 128 for c in cpu if c.level == "op")
    assert any(c.outliers for c in cpu if c.level == "expert") and any(c.magnitude == 8 for c in cpu)
    assert len({c.H for c in cpu}) >= 6                          # check's H is not always 64
    for act in SUPPORTED_ACTIVATIONS:                             # every activation in fp16 and in fp32
        got = {c.dtype for f in EXPERT_FEATURES if f.name == f"experts: {act}" for c in f.cases("cpu", 2)}
        assert got == {"float16", "float32"}, (act, got)
    big = [c for f in FEATURES for c in f.cases("cuda", 3)]
    assert all(not c.problems() for c in cpu + big)
    for level in ("op", "expert"):
        assert {129, 257} <= {c.T for c in big if c.level == level}, level


def test_rows_the_pairwise_rows_subsume_run_once_on_the_small_profile_only():
    from moe_lora_harness.harness.check.features import SUBSUMED_BY_PAIRWISE
    by_name = {f.name: f for f in FEATURES}
    for name in SUBSUMED_BY_PAIRWISE:
        f = by_name[name]
        assert len(f.cases("cpu", 2)) == 1 and len(f.cases("cuda", 3)) == 3, name
    assert len(by_name["experts: silu"].cases("cpu", 2)) == 2      # rows not subsumed keep theirs


def test_first_case_of_every_existing_row_is_unchanged():
    """Case 0 of the rows that were there before (the ones --cases-per-feature 1 runs) keeps the profile's H."""
    old = [f for f in OP_FEATURES + EXPERT_FEATURES
           if not f.name.startswith(("pairwise", "op: ", "experts: tokens across", "experts: top_k 8",
                                     "experts: many experts", "experts: swigluoai at", "experts: swiglustep /",
                                     "experts: outlier"))]
    for f in old:
        c = f.cases("cpu", 1)[0]
        assert c.H == f.make(SMALL).get("H", SMALL.H) and c.dtype == f.make(SMALL).get("dtype", SMALL.dtype), f.name
    assert LARGE.dtypes[0] == LARGE.dtype and SMALL.dtypes[0] == SMALL.dtype


@pytest.mark.parametrize("name,quant", [("expert", "int4_g128"), ("ep", "int4_g128"), ("fp8", "fp8_block")])
def test_group_scaled_schemes_reach_a_second_group_along_each_gemms_k(name, quant):
    # a scale read for the wrong group of 128 along K shows only where K holds two groups (H for GEMM1, I for GEMM2)
    strategy = S.fp8_cases(schemes=(quant,)) if name == "fp8" else _STRATEGIES[name](quants=(quant,))
    for dim in ("H", "I"):
        case = find(strategy, lambda c, d=dim: c.quant == quant and getattr(c, d) == 256, settings=_FIND)
        assert not case.problems()
