"""Tests of reference/precision.py and reference/lora_op.py (the float64 fused_moe_lora contract).

Inputs are random dyadic values (multiples of 1/8, never 0) and dyadic routing weights, so every
float64 sum and product below is exact: results must agree bit for bit whatever the summation order,
and the only roundings are the ones a Precision asks for.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_lora_harness.op_contract.validate import default_tuning, validate_call
from moe_lora_harness.reference import lora_op
from moe_lora_harness.reference.align import active_lora_ids, align_alloc, moe_lora_align_block_size
from moe_lora_harness.reference.lora_op import (
    PairLayout,
    fused_moe_lora,
    fused_moe_lora_expected,
    lora_expand,
    lora_shrink,
    qualifying_pairs,
)
from moe_lora_harness.reference.precision import PRESETS, Precision, eps, precision, rnd

F64 = torch.float64


# ------------------------------------------------------------------------------------ precision


def test_rnd_fp16_matches_numpy_correct_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20000, generator=g, dtype=F64) * torch.exp2(torch.randint(-30, 18, (20000,), generator=g)).to(F64)
    special = torch.tensor([1 + 2**-11 + 2**-40, 1 + 2**-11, 2**-25, 1.5 * 2**-24, 65519.99, 65520.0, -7e4, 0.0],
                           dtype=F64)
    x = torch.cat([x, special])
    with np.errstate(over="ignore"):
        want = torch.from_numpy(x.numpy().astype(np.float16).astype(np.float64))
    assert torch.equal(rnd(x, torch.float16), want)


def test_rnd_bf16_is_single_rounding():
    g = torch.Generator().manual_seed(2)
    x32 = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-100, 100, (20000,), generator=g).float())
    # for fp32-representable inputs torch's cast rounds once, so it is a valid oracle there
    assert torch.equal(rnd(x32.to(F64), torch.bfloat16), x32.to(torch.bfloat16).to(F64))
    # above the halfway point only in bits fp32 drops: a cast via fp32 would tie to even (1.0)
    assert rnd(torch.tensor([1 + 2**-8 + 2**-40], dtype=F64), torch.bfloat16).item() == 1 + 2**-7


def test_rnd_identity_and_errors():
    x = torch.randn(5, dtype=F64)
    assert torch.equal(rnd(x, None), x)
    assert torch.equal(rnd(x, torch.float32), x.float().double())
    with pytest.raises(ValueError, match="dtype"):
        rnd(x, torch.int32)
    with pytest.raises(TypeError, match="x must be"):
        rnd(torch.ones(3, dtype=torch.int64), torch.float16)


def test_precision_presets():
    assert precision("exact", torch.float16).dtype is None and precision("exact", torch.float16).exact
    flags = {n: (precision(n, torch.bfloat16).round_rank_intermediate, precision(n, torch.bfloat16).round_delta)
             for n in PRESETS}
    assert flags == {"exact": (False, False), "one_shot": (True, True), "two_kernel": (True, True),
                     "small_batch": (False, False), "dual_stream": (True, True),
                     "dual_stream_small_batch": (False, True)}
    with pytest.raises(ValueError, match="one_shot"):
        precision("oneshot", torch.float16)
    assert eps(torch.float16) == 2.0**-10 and eps(torch.bfloat16) == 2.0**-7


# ------------------------------------------------------------------------------------- fixtures


def _dyadic(shape, g, scale=8):
    v = torch.randint(-16, 17, shape, generator=g).to(F64)
    v[v == 0] = 1
    return v / scale


def _make_case(seed=0, T=9, k=2, E=4, L=3, R=8, K=16, N=12, S=2, dt=torch.float16, mul=False,
               offset=3, extra=2, shared_a=False, shared_b=False):
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    mapping = torch.randint(-1, L, (T,), generator=g).to(torch.int32)
    mapping[0], mapping[1] = -1, 0  # always a mix of no-adapter and adapter tokens
    enabled = torch.ones(L + 1, dtype=torch.int32)
    enabled[L] = 0
    x = _dyadic((T * k if mul else T, K), g).to(dt)
    A = [_dyadic((L, 1 if shared_a else E, R, K), g).to(dt) for _ in range(S)]
    B = [_dyadic((L, 1 if shared_b else E, N, R), g).to(dt) for _ in range(S)]
    w = (torch.randint(1, 17, (T, k), generator=g).float() / 16)
    out = _dyadic((T, k, offset + S * N + extra), g).to(dt)
    return dict(topk=topk, mapping=mapping, enabled=enabled, x=x, A=A, B=B, w=w, out=out, T=T, k=k, E=E, L=L,
                R=R, N=N, S=S, offset=offset, mul=mul)


def _sorted_args(c, bs=16):
    ids = active_lora_ids(c["mapping"], c["L"])
    s, e, n = align_alloc(c["topk"], bs, c["E"], c["L"])
    moe_lora_align_block_size(c["topk"], c["mapping"], c["E"], bs, c["L"], s.shape[1], e.shape[1], s, e, n,
                              c["enabled"], ids)
    return s, e, n, ids


def _expected(c, prec, sorted_mode=True, add_inputs=True, **kw):
    ids = active_lora_ids(c["mapping"], c["L"])
    if sorted_mode:
        s, e, n, ids = _sorted_args(c)
    else:
        s, e, n = None, c["topk"].reshape(-1), None
    return fused_moe_lora_expected(validate_call(
        c["out"], c["x"], c["A"], c["B"], c["w"], s, e, n, c["mapping"], c["R"], c["k"], ids,
        torch.tensor([c["L"] + 1], dtype=torch.int32), c["enabled"], **default_tuning(16),
        mul_routed_weight=c["mul"], offset=c["offset"], add_inputs=add_inputs), precision=prec, **kw)


def _direct(c, prec, add_inputs=True):
    """Per-pair loop straight from spec 1.2 (independent of the layout code)."""
    out = c["out"].to(F64).clone()
    written = torch.zeros(out.shape, dtype=torch.bool)
    T, k, N = c["T"], c["k"], c["N"]
    for t in range(T):
        l = int(c["mapping"][t])
        if l < 0 or l >= c["L"] or int(c["enabled"][l]) == 0:
            continue
        for j in range(k):
            e = int(c["topk"][t, j])
            if e < 0:
                continue
            p = t * k + j
            xr = c["x"][p if c["mul"] else t].to(F64)
            for s in range(c["S"]):
                a = c["A"][s][l, 0 if c["A"][s].shape[1] == 1 else e].to(F64)
                b = c["B"][s][l, 0 if c["B"][s].shape[1] == 1 else e].to(F64)
                u = a @ xr
                if prec.round_rank_intermediate:
                    u = prec.r(u)
                d = b @ u
                if c["mul"]:
                    d = d * float(c["w"][t, j])
                if prec.round_delta:
                    d = prec.r(d)
                cols = slice(c["offset"] + s * N, c["offset"] + (s + 1) * N)
                out[t, j, cols] = prec.r(out[t, j, cols] + d) if add_inputs else prec.r(d)
                written[t, j, cols] = True
    return out, written


# ------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("name", ["exact", "one_shot", "small_batch", "dual_stream_small_batch"])
@pytest.mark.parametrize("mul", [False, True])
def test_expected_matches_direct_loop_in_both_modes(name, mul):
    c = _make_case(seed=3, mul=mul)
    prec = precision(name, torch.float16)
    want, want_w = _direct(c, prec)
    for sorted_mode in (True, False):
        got = _expected(c, prec, sorted_mode=sorted_mode)
        assert torch.equal(got.written, want_w)
        assert torch.equal(got.value, want)
    # not vacuous: some pairs are written, some (mapping -1) are not, and rounding did happen
    assert want_w.any() and not want_w[0].any()
    if name == "one_shot":
        assert not torch.equal(want, _direct(c, precision("exact", None))[0])


@pytest.mark.parametrize("sorted_mode", [True, False])
def test_unwritten_elements_keep_prev_bitwise(sorted_mode):
    c = _make_case(seed=4, offset=5, extra=3)
    c["enabled"][2] = 0  # slot 2 disabled: its tokens get no delta
    c["mapping"][2] = 2
    got = _expected(c, precision("one_shot", torch.float16), sorted_mode=sorted_mode)
    prev = c["out"].to(F64)
    assert torch.equal(got.value[~got.written], prev[~got.written])
    assert torch.equal(got.scale[~got.written], prev.abs()[~got.written])
    no_lora = (c["mapping"] < 0) | (c["mapping"] == 2)
    assert no_lora.any() and not got.written[no_lora].any()
    assert not got.written[..., :5].any() and not got.written[..., 5 + c["S"] * c["N"]:].any()
    assert got.written[..., 5:5 + c["S"] * c["N"]].any()


def test_add_inputs_false_writes_only_the_rounded_delta():
    c = _make_case(seed=5)
    prec = precision("one_shot", torch.float16)
    got = _expected(c, prec, add_inputs=False)
    want, want_w = _direct(c, prec, add_inputs=False)
    assert torch.equal(got.written, want_w) and torch.equal(got.value, want)
    with_prev = _expected(c, prec, add_inputs=True)
    assert not torch.equal(got.value[got.written], with_prev.value[got.written])


def test_mul_routed_weight_selects_pair_rows_and_scales():
    c = _make_case(seed=6, mul=True)
    prec = precision("exact", None)
    got = _expected(c, prec)
    t, j = 1, 1  # token 1 maps to slot 0 (enabled)
    p = t * c["k"] + j
    e = int(c["topk"][t, j])
    d = c["B"][0][0, e].to(F64) @ (c["A"][0][0, e].to(F64) @ c["x"][p].to(F64)) * float(c["w"][t, j])
    cols = slice(c["offset"], c["offset"] + c["N"])
    assert torch.equal(got.value[t, j, cols], c["out"][t, j, cols].to(F64) + d)
    # without mul_routed_weight the row would be x[t] and no weight: a different value
    d_wrong = c["B"][0][0, e].to(F64) @ (c["A"][0][0, e].to(F64) @ c["x"][t].to(F64))
    assert not torch.equal(got.value[t, j, cols], c["out"][t, j, cols].to(F64) + d_wrong)


def test_routing_weight_is_promoted_through_fp32():
    c = _make_case(seed=7, mul=True)
    c["w"] = (torch.rand(c["T"], c["k"], generator=torch.Generator().manual_seed(0)).to(F64) + 0.1)
    got = _expected(c, precision("exact", None))
    c32 = dict(c, w=c["w"].float())
    assert torch.equal(got.value, _expected(c32, precision("exact", None)).value)


@pytest.mark.parametrize("shared", ["a", "b"])
def test_shared_lora_equals_expanded_weights(shared):
    c = _make_case(seed=8, shared_a=shared == "a", shared_b=shared == "b")
    key = "A" if shared == "a" else "B"
    expanded = dict(c, **{key: [w.expand(-1, c["E"], -1, -1).contiguous() for w in c[key]]})
    prec = precision("one_shot", torch.float16)
    assert torch.equal(_expected(c, prec).value, _expected(expanded, prec).value)


def test_zero_padded_rank_is_exact():
    c = _make_case(seed=9, R=4)
    padded = dict(c, R=16,
                  A=[torch.cat([a, torch.zeros(*a.shape[:2], 12, a.shape[3], dtype=a.dtype)], 2) for a in c["A"]],
                  B=[torch.cat([b, torch.zeros(*b.shape[:3], 12, dtype=b.dtype)], 3) for b in c["B"]])
    for name in ("exact", "one_shot", "small_batch"):
        prec = precision(name, torch.float16)
        assert torch.equal(_expected(c, prec).value, _expected(padded, prec).value)


def test_in_place_fused_moe_lora_matches_direct_loop():
    c = _make_case(seed=10, mul=True)
    prec = precision("one_shot", torch.float16)
    want, want_w = _direct(c, prec)
    out = c["out"].clone()
    s, e, n, ids = _sorted_args(c)
    tuning = [16, 32, 32, 1, 4, 3, 1, 16, 32, 16, 1, 4, 3, 1]
    fused_moe_lora(out, c["x"], c["A"], c["B"], c["w"], s, e, n, c["mapping"], c["R"], c["k"], ids,
                   torch.tensor([c["L"] + 1], dtype=torch.int32), c["enabled"], *tuning,
                   mul_routed_weight=True, offset=c["offset"], precision="one_shot")
    assert out.dtype == torch.float16 and torch.equal(out.to(F64), want)
    assert torch.equal(out[~want_w], c["out"][~want_w])


def test_duplicate_pair_from_malformed_align_is_added_twice():
    c = _make_case(seed=11)
    prec = precision("one_shot", torch.float16)
    layout = PairLayout(pair=torch.tensor([2, 2]), lora=torch.tensor([0, 0]), expert=torch.tensor([1, 1]))
    u = lora_shrink(c["x"], c["A"][:1], layout, c["k"], False, prec)
    got = lora_expand(c["out"].to(F64), u, c["B"][:1], None, layout, c["k"], False, 0, True, prec)
    d = prec.r(c["B"][0][0, 1].to(F64) @ u[0, 0])
    prev = c["out"][1, 0, :c["N"]].to(F64)
    assert torch.equal(got.value[1, 0, :c["N"]], prec.r(prec.r(prev + d) + d))


def test_qualifying_pairs_sorted_respects_active_count_and_guards():
    c = _make_case(seed=12)
    s, e, n, ids = _sorted_args(c)
    args = (s, e, n, c["mapping"], c["k"])
    tail = (c["enabled"], c["T"] * c["k"], c["L"], 16)
    full = qualifying_pairs(*args, ids, torch.tensor([c["L"] + 1]), *tail)
    assert len(full) > 0
    assert len(qualifying_pairs(*args, ids, torch.tensor([0]), *tail)) == 0
    bogus = torch.tensor([c["L"] + 2, -1, c["L"], -1], dtype=torch.int32)  # out of range, -1, the L entry
    assert len(qualifying_pairs(*args, bogus, torch.tensor([4]), *tail)) == 0
    # every qualifying pair has a real adapter token and its own expert
    t = torch.div(full.pair, c["k"], rounding_mode="floor")
    assert torch.equal(c["mapping"].long()[t], full.lora)
    assert torch.equal(c["topk"].reshape(-1).long()[full.pair], full.expert)


def test_sorted_mode_reads_only_blocks_below_num_tokens_post_padded():
    c = _make_case(seed=18, T=24, k=2, E=2)
    s, e, n, ids = _sorted_args(c)
    l = int(ids[ids >= 0][0])
    nal = torch.tensor([c["L"] + 1])
    tail = (c["enabled"], c["T"] * c["k"], c["L"], 16)
    full = qualifying_pairs(s, e, n, c["mapping"], c["k"], ids, nal, *tail)
    assert int(n[l]) >= 32  # at least two blocks for slot l
    cut = n.clone()
    cut[l] = 16  # stale ids past ntpp (here: real pairs) must be ignored, as the kernel's early exit does
    part = qualifying_pairs(s, e, cut, c["mapping"], c["k"], ids, nal, *tail)
    mine = full.lora == l
    assert len(part) < len(full)
    assert set(part.pair[part.lora == l].tolist()) == {v for v in s[l, :16].tolist() if v < c["T"] * c["k"]}
    assert torch.equal(part.pair[part.lora != l], full.pair[~mine])


def test_fully_sharded_all_gather_matches_unsharded():
    c = _make_case(seed=13, R=8)
    prec = precision("exact", None)
    full = _expected(c, prec)
    s, e, n, ids = _sorted_args(c)
    halves = [[a[:, :, r * 4:(r + 1) * 4].contiguous() for a in c["A"]] for r in range(2)]
    layout = qualifying_pairs(s, e, n, c["mapping"], c["k"], ids, torch.tensor([c["L"] + 1]), c["enabled"],
                              c["T"] * c["k"], c["L"], 16)
    other = lora_shrink(c["x"], halves[1], layout, c["k"], False, prec)
    got = fused_moe_lora_expected(validate_call(
        c["out"], c["x"], halves[0], c["B"], c["w"], s, e, n, c["mapping"], 4, c["k"], ids,
        torch.tensor([c["L"] + 1]), c["enabled"], **default_tuning(16), offset=c["offset"], fully_sharded=True),
        precision=prec, collective=lambda u: torch.cat([u, other], dim=-1))
    assert torch.equal(got.value, full.value)


def test_scale_is_forward_error_magnitude():
    c = _make_case(seed=14, mul=True)
    got = _expected(c, precision("exact", None))
    t, j = 1, 0
    e = int(c["topk"][t, j])
    p = t * c["k"] + j
    mag = c["B"][1][0, e].to(F64).abs() @ (c["A"][1][0, e].to(F64).abs() @ c["x"][p].to(F64).abs())
    cols = slice(c["offset"] + c["N"], c["offset"] + 2 * c["N"])
    want = c["out"][t, j, cols].to(F64).abs() + float(c["w"][t, j]) * mag
    assert torch.equal(got.scale[t, j, cols], want)


# ------------------------------------------------------------------------------- bad arguments


def _call(c, **over):
    s, e, n, ids = _sorted_args(c)
    kw = dict(output=c["out"], x=c["x"], A=c["A"], B=c["B"], w=c["w"], s=s, e=e, n=n, m=c["mapping"], R=c["R"],
              k=c["k"], ids=ids, nal=torch.tensor([c["L"] + 1]), en=c["enabled"], bm=16, mul=c["mul"],
              add=True, fs=False, prec=precision("exact", None))
    kw.update(over)
    return fused_moe_lora_expected(validate_call(
        kw["output"], kw["x"], kw["A"], kw["B"], kw["w"], kw["s"], kw["e"], kw["n"], kw["m"], kw["R"], kw["k"],
        kw["ids"], kw["nal"], kw["en"], **default_tuning(kw["bm"]), mul_routed_weight=kw["mul"],
        add_inputs=kw["add"], fully_sharded=kw["fs"]), precision=kw["prec"])


@pytest.mark.parametrize("over, exc, text", [
    (lambda c: dict(B=c["B"][:1]), ValueError, "same length S"),
    (lambda c: dict(x=c["x"][:-1]), ValueError, "qcurr_hidden_states must have shape"),
    (lambda c: dict(mul=True), ValueError, r"\(T\*k, K\)"),
    (lambda c: dict(bm=24), ValueError, "power of two"),
    (lambda c: dict(k=3), ValueError, "top_k_num"),
    (lambda c: dict(fs=True, add=False), ValueError, "add_inputs"),
    (lambda c: dict(A=[a.float() for a in c["A"]]), TypeError, "lora_a_stacked"),
    (lambda c: dict(R=4), ValueError, "max_lora_rank"),
    (lambda c: dict(m=c["mapping"][:-1]), ValueError, "token_lora_mapping"),
    (lambda c: dict(n=None), ValueError, "num_tokens_post_padded"),
    (lambda c: dict(e=c["topk"]), ValueError, "expert_ids"),
    (lambda c: dict(m=c["mapping"].float()), TypeError, "token_lora_mapping"),
    (lambda c: dict(output=c["out"][:, :, :2]), ValueError, "offset"),
    (lambda c: dict(nal=torch.tensor([99])), ValueError, "num_active_loras"),
    (lambda c: dict(prec="one_shot"), TypeError, "precision"),
])
def test_bad_arguments_raise_clear_errors(over, exc, text):
    c = _make_case(seed=15)
    with pytest.raises(exc, match=text):
        _call(c, **over(c))


def test_naive_expert_out_of_range_is_rejected():
    c = _make_case(seed=16)
    ids = active_lora_ids(c["mapping"], c["L"])
    e = c["topk"].reshape(-1).clone()
    e[2] = c["E"]  # token 1 has an adapter, so pair 2 qualifies
    with pytest.raises(ValueError, match="local expert ids must be < E"):
        fused_moe_lora_expected(validate_call(c["out"], c["x"], c["A"], c["B"], c["w"], None, e, None, c["mapping"],
                                              c["R"], c["k"], ids, torch.tensor([1]), c["enabled"], **default_tuning(16)),
                                precision=precision("exact", None))


def test_fused_moe_lora_rejects_bad_tuning_and_preset():
    c = _make_case(seed=17)
    s, e, n, ids = _sorted_args(c)
    args = [c["out"].clone(), c["x"], c["A"], c["B"], c["w"], s, e, n, c["mapping"], c["R"], c["k"], ids,
            torch.tensor([c["L"] + 1]), c["enabled"]]
    with pytest.raises(ValueError, match="shrink_num_warps"):
        fused_moe_lora(*args, 16, 32, 32, 1, 0, 3, 1, 16, 32, 16, 1, 4, 3, 1)
    with pytest.raises(ValueError, match="precision name"):
        fused_moe_lora(*args, 16, 32, 32, 1, 4, 3, 1, 16, 32, 16, 1, 4, 3, 1, precision="fast")
    assert isinstance(precision("one_shot", torch.float16), Precision)


@pytest.mark.parametrize("model", [None, "one_shot_tf32"])
def test_the_batched_gathers_give_the_loops_values(model, monkeypatch):
    """_gathered_matvecs' batched form (a GPU's: rows padded per chunk of (slot, expert) weights) against its loop
    over the weights (the CPU's): the same values to float64 rounding for every job, on skewed group sizes, with
    chunks forced small (several memory chunks and the halving rule at work), a shared A, and a GEMM model that
    rounds its operands. A row written from another group's weight differs by O(1)."""
    monkeypatch.setattr(lora_op, "GROUPED_BYTES", 1 << 15)
    g = torch.Generator().manual_seed(5)
    prec = None if model is None else precision(model, torch.float32)
    for E in (6, 1):
        w = torch.randn(3, E, 5, 40, generator=g)
        P = 90
        lora = torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), P, replacement=True, generator=g)
        expert = torch.multinomial(torch.linspace(1.0, 0.1, 6), P, replacement=True, generator=g)
        vec = torch.randn(P, 40, generator=g, dtype=torch.float64)
        jobs = {"v": (vec, None), "a": (vec.abs(), "abs"), "s": (vec * vec, "square")}
        loop = lora_op._gathered_matvecs(w, lora, expert, jobs, prec, batched=False)
        batch = lora_op._gathered_matvecs(w, lora, expert, jobs, prec, batched=True)
        for name in jobs:
            torch.testing.assert_close(batch[name], loop[name], rtol=1e-13, atol=1e-13)
        e = lora_op._expert_index(w, expert)
        direct = torch.stack([w[lora[p], e[p]].double() @ vec[p] for p in range(P)])
        if prec is None:
            torch.testing.assert_close(batch["v"], direct, rtol=1e-13, atol=1e-13)
