"""Tests of reference/experts.py: the MoE expert forward with LoRA (spec 5) and its rounding emulation."""

import pytest
import torch

from moe_lora_harness.reference.activations import SUPPORTED_ACTIVATIONS, apply_activation, is_gated
from moe_lora_harness.reference.adapters import StackedMoELoRA
from moe_lora_harness.reference.experts import ExpertExpected, LoRACollectives, LoRAInputs, moe_experts_forward
from moe_lora_harness.reference.precision import PRESETS, eps, precision, rnd

from .random_layer import random_layer

F64 = torch.float64
EXACT = precision("exact", None)
EMULATED = [p for p in PRESETS if p != "exact"]
T, H, I, E, K, L, R = 6, 16, 8, 4, 2, 3, 8


def make_layer(seed, *, gated=True, dtype=torch.float16, T=T, k=K, E=E, bias=False, shared=False,
               ranks=(R, 3), scaling=0.5):
    """Random non-trivial layer + LoRA: slot 0 full rank, slot 1 smaller rank, slot 2 empty (disabled)."""
    return random_layer(seed, T=T, H=H, I=I, E=E, k=k, L=L, max_rank=R, ranks=ranks, gated=gated, dtype=dtype,
                        bias=bias, shared=shared, scaling=scaling)


def fwd(layer, lora, prec, activation="silu", **kw):
    return moe_experts_forward(**layer, activation=activation, precision=prec, lora=lora, **kw)


def loop_reference(layer, lora, activation, apply_router_weight_on_input=False):
    """Independent per-(token, slot) float64 loop of spec 5 (exact: no rounding)."""
    x = layer["hidden"].double()
    W13, W2 = layer["w13"].double(), layer["w2"].double()
    b13, b2 = layer.get("w13_bias"), layer.get("w2_bias")
    w = layer["topk_weights"].float().double()
    st = lora.stacked
    out = torch.zeros(x.shape[0], H, dtype=F64)
    for t in range(x.shape[0]):
        for j in range(w.shape[1]):
            e = int(layer["topk_ids"][t, j])
            xin = x[t] * w[t, j] if apply_router_weight_on_input else x[t]
            c1 = W13[e] @ xin + (b13[e].double() if b13 is not None else 0)
            l = int(lora.token_lora_mapping[t])
            on = 0 <= l < L and int(st.adapter_enabled[l]) != 0
            if on:
                ds = [st.w13_b[s][l, e].double() @ (st.w13_a[s][l, min(e, st.w13_a[s].shape[1] - 1)].double() @ x[t])
                      for s in range(st.num_slices)]
                if activation == "swigluoai":
                    c1[0::2] += ds[0]
                    c1[1::2] += ds[1]
                else:
                    c1 += torch.cat(ds)
            a = apply_activation(c1[None], activation)[0]
            c3 = W2[e] @ a + (b2[e].double() if b2 is not None else 0)
            if not apply_router_weight_on_input:
                c3 = w[t, j] * c3
            if on:
                eb = min(e, st.w2_b[0].shape[1] - 1)
                c3 += w[t, j] * (st.w2_b[0][l, eb].double() @ (st.w2_a[0][l, e].double() @ a))
            out[t] += c3
    return out


def assert_close64(a, b, rel=1e-12):
    """Equal up to float64 summation order: relative to the largest magnitude."""
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item(), f"max abs diff {err:g} vs scale {b.abs().max().item():g}"


@pytest.mark.parametrize("activation,gated,bias,shared", [
    ("silu", True, True, False), ("swigluoai", True, True, True), ("relu2_no_mul", False, False, False),
    ("gelu_tanh", True, False, True),
])
def test_exact_matches_independent_loop(activation, gated, bias, shared):
    layer, lora = make_layer(1, gated=gated, dtype=torch.float32, bias=bias, shared=shared)
    got = fwd(layer, lora, EXACT, activation)
    assert isinstance(got, ExpertExpected) and got.value.dtype == F64 and got.value.shape == (T, H)
    assert_close64(got.value, loop_reference(layer, lora, activation))


def test_apply_router_weight_on_input_matches_loop():
    layer, lora = make_layer(2, dtype=torch.float32, k=1, bias=True)
    got = fwd(layer, lora, EXACT, apply_router_weight_on_input=True)
    assert_close64(got.value, loop_reference(layer, lora, "silu", apply_router_weight_on_input=True))
    # and it is a different computation from the weight-after-GEMM2 default
    assert (got.value - fwd(layer, lora, EXACT).value).abs().max() > 1e-3


def test_zero_lora_is_base_bit_exact_every_precision():
    layer, lora = make_layer(3, bias=True)
    for zero_b in (True, False):  # zero B (non-zero shrink) and zero A (non-zero B)
        st = lora.stacked.clone()
        for bufs in ((st.w13_b, st.w2_b) if zero_b else (st.w13_a, st.w2_a)):
            for t in bufs:
                t.zero_()
        zl = LoRAInputs(st, lora.token_lora_mapping)
        for name in PRESETS:
            prec = precision(name, torch.float16)
            assert torch.equal(fwd(layer, zl, prec).value, fwd(layer, None, prec).value), name


def test_no_adapter_tokens_equal_base_rows():
    """Tokens mapped to -1 or to a disabled slot get no LoRA: their rows equal the base, bit for bit."""
    layer, lora = make_layer(4)
    m = lora.token_lora_mapping
    plain = (m == -1) | (m == 2)  # slot 2 is empty (adapter_enabled 0)
    assert bool(plain.any()) and bool((~plain).any())
    for name in PRESETS:
        prec = precision(name, torch.float16)
        with_lora, base = fwd(layer, lora, prec).value, fwd(layer, None, prec).value
        assert torch.equal(with_lora[plain], base[plain]), name
        assert bool((with_lora[~plain] != base[~plain]).any()), name
    # lora_ids lacking slot 1 (a sorted-mode grid that never visits it): slot 1 tokens get no LoRA
    only0 = LoRAInputs(lora.stacked, m, lora_ids=torch.tensor([-1, 0, -1, -1], dtype=torch.int32))
    got = fwd(layer, only0, EXACT).value
    assert torch.equal(got[m == 1], fwd(layer, None, EXACT).value[m == 1])
    assert torch.equal(got[m == 0], fwd(layer, lora, EXACT).value[m == 0])


def test_linear_in_lora_b_float64():
    layer, lora = make_layer(5, dtype=torch.float32)
    st2 = lora.stacked.clone()
    st2.w2_b[0].mul_(2)
    base = fwd(layer, LoRAInputs(_without_w2_lora(lora.stacked), lora.token_lora_mapping), EXACT).value
    one = fwd(layer, lora, EXACT).value
    two = fwd(layer, LoRAInputs(st2, lora.token_lora_mapping), EXACT).value
    assert (one - base).abs().max() > 1e-2
    assert_close64(two - base, 2 * (one - base))
    # the w13 delta (before the non-linear activation) is linear in the w13 B factors
    st13 = lora.stacked.clone()
    for t in st13.w13_b:
        t.mul_(2)
    c_base = fwd(layer, None, EXACT, return_intermediates=True).cache1
    c_one = fwd(layer, lora, EXACT, return_intermediates=True).cache1
    c_two = fwd(layer, LoRAInputs(st13, lora.token_lora_mapping), EXACT, return_intermediates=True).cache1
    assert_close64(c_two - c_base, 2 * (c_one - c_base))


def _without_w2_lora(st: StackedMoELoRA) -> StackedMoELoRA:
    out = st.clone()
    out.w2_b[0].zero_()
    return out


def test_token_permutation_commutes():
    layer, lora = make_layer(6, bias=True)
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(0))
    player = {k: (v[perm] if k in ("hidden", "topk_weights", "topk_ids") else v) for k, v in layer.items()}
    plora = LoRAInputs(lora.stacked, lora.token_lora_mapping[perm])
    for name in ("exact", "one_shot"):
        prec = precision(name, torch.float16)
        a, b = fwd(layer, lora, prec).value, fwd(player, plora, prec).value
        assert_close64(b, a[perm])


def test_expert_map_all_local_equals_no_map_and_nonlocal_dropped():
    layer, lora = make_layer(7)
    prec = precision("one_shot", torch.float16)
    ref = fwd(layer, lora, prec)
    same = fwd(layer, lora, prec, expert_map=torch.arange(E, dtype=torch.int32))
    assert torch.equal(same.value, ref.value) and torch.equal(same.scale, ref.scale)
    # local ids are what the layer's weights and LoRA are indexed with; non-local pairs drop out
    emap = torch.tensor([-1, 1, 0, -1], dtype=torch.int32)  # global 1 -> local 1, global 2 -> local 0
    local_layer = dict(layer, w13=layer["w13"][[2, 1]], w2=layer["w2"][[2, 1]])
    st = lora.stacked
    local_st = StackedMoELoRA([a[:, [2, 1]] for a in st.w13_a], [b[:, [2, 1]] for b in st.w13_b],
                              [st.w2_a[0][:, [2, 1]]], [st.w2_b[0][:, [2, 1]]], st.adapter_enabled)
    got = fwd(local_layer, LoRAInputs(local_st, lora.token_lora_mapping), EXACT, expert_map=emap)
    keep = (layer["topk_ids"] == 1) | (layer["topk_ids"] == 2)
    masked = dict(layer, topk_weights=layer["topk_weights"] * keep)  # w = 0 kills a pair exactly in float64
    assert_close64(got.value, fwd(masked, lora, EXACT).value)


@pytest.mark.parametrize("activation", SUPPORTED_ACTIVATIONS)
def test_every_activation_emulation_within_ulp_bound(activation):
    """Emulated output is dt-representable, differs from the exact one, and by at most 4.5 eps * scale.

    First-order bound: stage 1 rounds at most 4 times (base, u, delta, add), each <= eps/2 of a
    magnitude the scale dominates; the activation's 2 roundings are covered by its |h| term; stage 3
    adds 4 more and moe_sum 1: 9 half-ulps in all, i.e. 4.5 eps * scale.
    """
    gated = is_gated(activation)
    for dt in (torch.float16, torch.bfloat16):
        layer, lora = make_layer(8, gated=gated, dtype=dt, bias=True)
        exact = fwd(layer, lora, EXACT, activation)
        for name in EMULATED:
            got = fwd(layer, lora, precision(name, dt), activation, return_intermediates=True)
            assert torch.isfinite(got.value).all()
            for c in (got.value, got.cache1, got.cache2, got.cache3):  # where it says rounded, rounded it is
                assert torch.equal(rnd(c, dt), c), (activation, name)
            err = (got.value - exact.value).abs()
            assert bool((err > 0).any()), (activation, name)
            bound = 4.5 * eps(dt) * exact.scale
            assert bool((err <= bound).all()), (activation, name, (err / exact.scale).max().item())


@pytest.mark.parametrize("on_input", [False, True])
def test_rounding_points_by_hand(on_input):
    """The emulation rounds exactly where spec 1.4/1.5/5 say (k = 1, written out per token by hand).

    on_input: base input r(x * r(w)) (vLLM casts w to dt before the multiply), GEMM2 unweighted,
    LoRA fed the unweighted x and the w2 delta still weighted.
    """
    dt = torch.float16
    layer, lora = make_layer(9, dtype=dt, T=4, k=1, ranks=(R,), bias=True)
    st = lora.stacked
    r = lambda v: rnd(v, dt)  # noqa: E731
    one = LoRAInputs(st, torch.zeros(4, dtype=torch.int32))
    for name in ("one_shot", "small_batch", "dual_stream_small_batch"):
        p = precision(name, dt)
        ri = r if p.round_rank_intermediate else (lambda v: v)
        rd = r if p.round_delta else (lambda v: v)
        got = fwd(layer, one, p, apply_router_weight_on_input=on_input).value
        for t in range(4):
            x, wt = layer["hidden"].double()[t], layer["topk_weights"].float().double()[t, 0]
            e = int(layer["topk_ids"][t, 0])
            xin = r(x * r(wt)) if on_input else x
            c1 = r(layer["w13"][e].double() @ xin + layer["w13_bias"][e].double())
            d = torch.cat([rd(st.w13_b[s][0, e].double() @ ri(st.w13_a[s][0, e].double() @ x)) for s in range(2)])
            c1 = r(c1 + d)
            a = apply_activation(c1[None], "silu", dt)[0]
            c3 = layer["w2"][e].double() @ a + layer["w2_bias"][e].double()
            c3 = r(c3 if on_input else wt * c3)
            d2 = rd(wt * (st.w2_b[0][0, e].double() @ ri(st.w2_a[0][0, e].double() @ a)))
            assert torch.equal(got[t], r(r(c3 + d2))), (name, t)


def test_scale_of_base_by_hand():
    """Base-only scale: |w| (|W2| s2 + |b2|) with s2 = activation_scale(c1, |W13||x| + |b1|), summed over k."""
    from moe_lora_harness.reference.activations import activation_scale
    layer, _ = make_layer(12, bias=True)
    got = fwd(layer, None, precision("one_shot", torch.float16))
    x, w = layer["hidden"].double(), layer["topk_weights"].float().double()
    for t in range(T):
        want = torch.zeros(H, dtype=F64)
        for j in range(K):
            e = int(layer["topk_ids"][t, j])
            c1 = rnd(layer["w13"][e].double() @ x[t] + layer["w13_bias"][e].double(), torch.float16)
            s1 = layer["w13"][e].double().abs() @ x[t].abs() + layer["w13_bias"][e].double().abs()
            s2 = activation_scale(c1[None], s1[None], "silu")[0]
            want += w[t, j] * (layer["w2"][e].double().abs() @ s2 + layer["w2_bias"][e].double().abs())
        assert_close64(got.scale[t], want)


def test_joined_shrink_cache_is_rerounded():
    """A collective's output is rounded again on paths that round the intermediate (a dt cache).

    A join that nudges u by 2**-13 relative (below half an fp16 ulp) must vanish after re-rounding;
    in exact precision nothing is rounded and the nudge shows.
    """
    layer, lora = make_layer(13)
    nudge = LoRACollectives(w13=lambda c: c * (1 + 2**-13), w2=lambda c: c * (1 + 2**-13))
    ident = LoRACollectives(w13=lambda c: c, w2=lambda c: c)
    for name in ("one_shot", "two_kernel", "exact"):
        p = precision(name, torch.float16)
        a = fwd(layer, lora, p, lora_collectives=nudge).value
        b = fwd(layer, lora, p, lora_collectives=ident).value
        assert torch.equal(b, fwd(layer, lora, p).value)
        assert torch.equal(a, b) == (name != "exact"), name


def test_scale_dominates_magnitudes():
    layer, lora = make_layer(10, bias=True)
    got = fwd(layer, lora, EXACT)
    assert bool((got.scale >= got.value.abs()).all()) and bool((got.scale > 0).all())


def test_bad_arguments_raise_clear_errors():
    layer, lora = make_layer(11)
    with pytest.raises(ValueError, match="topk_ids must hold expert ids in"):
        fwd(dict(layer, topk_ids=layer["topk_ids"] + E), lora, EXACT)
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k == 1"):
        fwd(layer, lora, EXACT, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="w13 must have shape"):
        fwd(dict(layer, w13=layer["w13"][:, :I]), lora, EXACT)
    with pytest.raises(ValueError, match="must have 1 w13 slice"):
        fwd(dict(layer, w13=layer["w13"][:, :I]), lora, EXACT, activation="silu_no_mul")
    with pytest.raises(ValueError, match="topk_weights must be a floating tensor of shape"):
        fwd(dict(layer, topk_weights=layer["topk_weights"][:, :1]), lora, EXACT)
    with pytest.raises(ValueError, match="expert_map values must be local ids"):
        fwd(layer, lora, EXACT, expert_map=torch.tensor([0, 1, 2, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="relu2"):
        fwd(layer, lora, EXACT, activation="relu2")
    with pytest.raises(ValueError, match="token_lora_mapping must have shape"):
        fwd(layer, LoRAInputs(lora.stacked, lora.token_lora_mapping[:-1]), EXACT)
    with pytest.raises(TypeError, match="precision must be"):
        fwd(layer, lora, "exact")


@pytest.mark.parametrize("skewed", [False, True])
def test_coarse_accumulation_over_every_expert_at_once_keeps_each_experts_bits(monkeypatch, skewed):
    """A coarse-accumulation model (one_shot_fp16acc) runs its K loop for every expert at once, rows padded: the same
    bits as expert by expert (the memory cap forces the loop); an expert with no rows and rows of no expert stay 0."""
    from moe_lora_harness.reference import experts as ref
    g = torch.Generator().manual_seed(3)
    P, K, N, E = 40, 24, 12, 5
    x = torch.randn(P, K, generator=g, dtype=F64)
    w = torch.randn(E, N, K, generator=g).to(torch.float16)
    ids = torch.randint(-1, E - 1, (P,), generator=g)           # expert E-1 gets no row; -1: not local
    if skewed:
        ids[: P // 2] = 0
    prec = precision("one_shot_fp16acc", torch.float16)
    jobs = {"y": (x, None), "m": (x.abs(), "abs")}
    batched = ref._per_expert_gemms(jobs, w, ids, prec)
    monkeypatch.setattr(ref, "BATCHED_ACCUMULATION_BYTES", 0)
    looped = ref._per_expert_gemms(jobs, w, ids, prec)
    for name in jobs:
        assert torch.equal(batched[name], looped[name]), name
    assert batched["y"][ids < 0].eq(0).all() and batched["y"][ids >= 0].ne(0).any()
    plain = ref._per_expert_gemms(jobs, w, ids, precision("one_shot", torch.float16))
    assert not torch.equal(batched["y"], plain["y"])      # the model does change the sums: the test can fail
