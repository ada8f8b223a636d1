"""Tests of reference/sharding.py: TP / fully-sharded / EP slicing, collectives, the sharded forward."""

import pytest
import torch

from moe_lora_harness.reference.adapters import ExpertAdapter, pack_moe_lora
from moe_lora_harness.reference.experts import LoRAInputs, moe_experts_forward
from moe_lora_harness.reference.precision import eps, precision, rnd
from moe_lora_harness.reference.sharding import (
    all_gather_last, all_reduce_sum, ep_combine, ep_dispatch, ep_expert_map, ep_slice_base, ep_slice_lora,
    sharded_experts_forward, tp_slice_base, tp_slice_lora,
)

from .random_layer import random_layer

F64 = torch.float64
EXACT = precision("exact", None)
T, H, I, E, K, L, R = 7, 16, 8, 4, 2, 3, 8


def make_layer(seed, *, gated=True, dtype=torch.float32, shared=False, bias=True):
    """Random layer (biases on) and LoRA: slots 0/1 with adapters (rank R and 4), slot 2 empty."""
    return random_layer(seed, T=T, H=H, I=I, E=E, k=K, L=L, max_rank=R, ranks=(R, 4), gated=gated, dtype=dtype,
                        bias=bias, shared=shared)


def assert_close64(a, b, rel=1e-12):
    """Equal up to float64 summation order: relative to the largest magnitude."""
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item(), f"max abs diff {err:g} vs {b.abs().max().item():g}"


# ------------------------------------------------------------------------------------- slicing

def test_tp_slice_base_split_and_interleaved_layouts():
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    for tp in (2, 4):
        parts = [tp_slice_base(w13, w2, tp, r, True, b13, b2) for r in range(tp)]
        s = I // tp
        for r, (p13, p2, pb13, pb2) in enumerate(parts):
            assert torch.equal(p13, torch.cat([w13[:, r * s:(r + 1) * s], w13[:, I + r * s:I + (r + 1) * s]], 1))
            assert torch.equal(pb13, torch.cat([b13[:, r * s:(r + 1) * s], b13[:, I + r * s:I + (r + 1) * s]], 1))
            assert torch.equal(p2, w2[:, :, r * s:(r + 1) * s])
        assert torch.equal(torch.cat([p[1] for p in parts], 2), w2)
        assert torch.equal(parts[0][3], b2) and all(bool((p[3] == 0).all()) for p in parts[1:])
        # interleaved (swigluoai) rows g0,u0,g1,u1..: each rank holds contiguous (g_i, u_i) pairs
        inter = [tp_slice_base(w13, w2, tp, r, True, b13, interleaved=True) for r in range(tp)]
        assert torch.equal(torch.cat([p[0] for p in inter], 1), w13)
        assert torch.equal(inter[1][0][:, 0::2], w13[:, 0::2][:, s:2 * s])  # gate rows of shard 1
        assert inter[0][3] is None
    p13, p2, _, _ = tp_slice_base(w13[:, :I], w2, 2, 1, False)
    assert torch.equal(p13, w13[:, I // 2:I])
    with pytest.raises(ValueError, match="intermediate size I=8 is not divisible"):
        tp_slice_base(w13, w2, 3, 0, True)
    with pytest.raises(ValueError, match="tp_rank must be an int in"):
        tp_slice_base(w13, w2, 2, 2, True)
    with pytest.raises(ValueError, match="w13 dim 1 must be 2"):
        tp_slice_base(w13[:, :I], w2, 2, 0, True)


def test_tp_slice_lora_per_spec_table():
    _, lora = make_layer(1)
    st = lora.stacked
    for fully in (False, True):
        for r in range(2):
            p = tp_slice_lora(st, 2, r, fully)
            ir, hr = slice(r * I // 2, (r + 1) * I // 2), slice(r * H // 2, (r + 1) * H // 2)
            rr = slice(r * R // 2, (r + 1) * R // 2)
            for s in range(2):
                assert torch.equal(p.w13_a[s], st.w13_a[s][:, :, rr] if fully else st.w13_a[s])
                assert torch.equal(p.w13_b[s], st.w13_b[s][:, :, ir])
            assert torch.equal(p.w2_a[0], st.w2_a[0][..., ir])
            assert torch.equal(p.w2_b[0], st.w2_b[0][:, :, hr] if fully else st.w2_b[0])
            assert p.max_rank == R and torch.equal(p.adapter_enabled, st.adapter_enabled)
    with pytest.raises(ValueError, match="max_rank R .*=6 is not divisible by the parallel size 4"):
        tp_slice_lora(_rank6(), 4, 0, True)
    with pytest.raises(ValueError, match="intermediate size I=8 is not divisible by the parallel size 3"):
        tp_slice_lora(st, 3, 0, False)


def _rank6():
    ad = ExpertAdapter.random(E, H, I, 6, True, 1.0, torch.Generator().manual_seed(3))
    return pack_moe_lora([ad], max_loras=1, max_rank=6, num_experts=E, hidden_size=H, intermediate_size=I,
                         dtype=torch.float32, gated=True)


def test_ep_expert_map_and_slicing():
    assert ep_expert_map(8, 4, 1).tolist() == [-1, -1, 0, 1, -1, -1, -1, -1]
    assert ep_expert_map(8, 4, 1).dtype == torch.int32
    # vLLM's linear rule for an uneven split: rank r starts at r*base + min(r, remainder)
    uneven = [ep_expert_map(10, 4, r, allow_uneven=True) for r in range(4)]
    assert [int((m >= 0).sum()) for m in uneven] == [3, 3, 2, 2]
    assert [int((m >= 0).nonzero()[0]) for m in uneven] == [0, 3, 6, 8]
    local_ids = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 0, 1], dtype=torch.int32)
    assert torch.equal(torch.stack(uneven).max(0).values, local_ids)
    with pytest.raises(ValueError, match="not divisible by ep_size=4.*uneven split caveat"):
        ep_expert_map(10, 4, 0)
    _, lora = make_layer(2, shared=True)
    st = lora.stacked
    p = ep_slice_lora(st, 2, 1)
    assert p.num_experts == 2 and torch.equal(p.w13_b[0], st.w13_b[0][:, 2:4])
    assert torch.equal(p.w2_a[0], st.w2_a[0][:, 2:4])
    assert torch.equal(p.w13_a[0], st.w13_a[0]) and torch.equal(p.w2_b[0], st.w2_b[0])  # shared kept whole
    layer, _ = make_layer(2)
    w13, w2, (b13, b2) = ep_slice_base(layer["w13"], layer["w2"], (layer["w13_bias"], None), 2, 0)
    assert torch.equal(w13, layer["w13"][:2]) and torch.equal(w2, layer["w2"][:2])
    assert torch.equal(b13, layer["w13_bias"][:2]) and b2 is None
    with pytest.raises(ValueError, match="number of experts E=4 is not divisible"):
        ep_slice_base(layer["w13"], layer["w2"], (None, None), 3, 0)


def test_collectives():
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(2, 3, r + 1, generator=g, dtype=F64) for r in range(3)]
    got = all_gather_last(parts)
    assert got.shape == (2, 3, 6) and torch.equal(got[..., 1:3], parts[1]) and torch.equal(got[..., 3:], parts[2])
    same = [torch.randn(2, 3, generator=g, dtype=F64) for _ in range(3)]
    assert torch.equal(all_reduce_sum(same), same[0] + same[1] + same[2])
    with pytest.raises(ValueError, match="share one shape"):
        all_reduce_sum([same[0], parts[0]])
    # dispatch all-gathers tokens with their LoRA mapping; combine sums and scatters back by source
    hs = [torch.randn(n, 4, generator=g, dtype=F64) for n in (2, 3)]
    ws = [torch.rand(n, 2, generator=g) for n in (2, 3)]
    ids = [torch.randint(0, 4, (n, 2), generator=g, dtype=torch.int32) for n in (2, 3)]
    maps = [torch.tensor([0, -1], dtype=torch.int32), torch.tensor([1, 1, 2], dtype=torch.int32)]
    h, w, i, m, counts = ep_dispatch(hs, ws, ids, maps)
    assert counts == [2, 3] and torch.equal(h[2:], hs[1]) and torch.equal(i[:2], ids[0])
    assert torch.equal(w[2:], ws[1]) and torch.equal(m, torch.tensor([0, -1, 1, 1, 2], dtype=torch.int32))
    outs = [torch.randn(5, 4, generator=g, dtype=F64) for _ in range(2)]
    back = ep_combine(outs, counts)
    assert torch.equal(back[1], (outs[0] + outs[1])[2:])
    with pytest.raises(ValueError, match="rank 1's topk_w/topk_ids/mapping must have 3 rows"):
        ep_dispatch(hs, ws, ids, [maps[0], maps[1][:2]])


# ------------------------------------------------------------------------------ sharded forward

@pytest.mark.parametrize("activation,gated,shared", [("silu", True, False), ("swigluoai", True, True),
                                                     ("gelu_no_mul", False, False)])
@pytest.mark.parametrize("mode", [("tp", 2, False), ("tp", 4, False), ("tp", 2, True), ("ep", 2, False),
                                  ("ep", 4, False)])
def test_sharded_equals_unsharded_float64(activation, gated, shared, mode):
    kind, size, fully = mode
    layer, lora = make_layer(5, gated=gated, shared=shared)
    ref = moe_experts_forward(**layer, activation=activation, precision=EXACT, lora=lora)
    kw = dict(tp_size=size) if kind == "tp" else dict(ep_size=size)
    got = sharded_experts_forward(**layer, activation=activation, precision=EXACT, lora=lora,
                                  fully_sharded=fully, **kw)
    assert_close64(got.value, ref.value)
    assert_close64(got.scale, ref.scale)
    # the LoRA matters in this comparison (a sharding that dropped it would fail)
    assert (ref.value - moe_experts_forward(**layer, activation=activation, precision=EXACT).value).abs().max() > 1e-2


def test_ep_uneven_token_split_and_router_weight_on_input():
    layer, lora = make_layer(6)
    layer1 = dict(layer, topk_weights=layer["topk_weights"][:, :1], topk_ids=layer["topk_ids"][:, :1])
    for on_input, lay in ((False, layer), (True, layer1)):
        ref = moe_experts_forward(**lay, activation="silu", precision=EXACT, lora=lora,
                                  apply_router_weight_on_input=on_input)
        got = sharded_experts_forward(**lay, activation="silu", precision=EXACT, lora=lora, ep_size=2,
                                      tokens_per_rank=[5, 2], apply_router_weight_on_input=on_input)
        assert_close64(got.value, ref.value)
        tp = sharded_experts_forward(**lay, activation="silu", precision=EXACT, lora=lora, tp_size=2,
                                     fully_sharded=True, apply_router_weight_on_input=on_input)
        assert_close64(tp.value, ref.value)


def test_w13_gather_order_matters():
    """A fully-sharded w13 all-gather in the wrong rank order must give a visibly different result."""
    layer, lora = make_layer(7)
    ref = moe_experts_forward(**layer, activation="silu", precision=EXACT, lora=lora)
    rev = sharded_experts_forward(**layer, activation="silu", precision=EXACT, lora=lora, tp_size=2,
                                  fully_sharded=True, w13_gather=lambda ps: all_gather_last(list(ps)[::-1]))
    err = (rev.value - ref.value).abs().max().item()
    assert err > 1e-3 * ref.value.abs().max().item()
    with pytest.raises(AssertionError):
        assert_close64(rev.value, ref.value)


@pytest.mark.parametrize("kw", [dict(tp_size=2, fully_sharded=True), dict(tp_size=2), dict(ep_size=2)])
def test_sharded_emulation_within_ulp_bound(kw):
    """Emulated sharded fp16 (two-kernel path) stays within 5.5 eps * scale of the exact truth.

    The unsharded count (9 half-ulps) plus two: the w2 shrink partials are rounded per rank and
    their all-reduced sum once more, and the final all-reduce of the rank outputs rounds once.
    Per-rank outputs are each within the bound of their own scale and the layer's scale is the sum
    of the ranks' scales: 11 half-ulps = 5.5 eps.
    """
    layer, lora = make_layer(8, dtype=torch.float16)
    ref = moe_experts_forward(**layer, activation="silu", precision=EXACT, lora=lora)
    got = sharded_experts_forward(**layer, activation="silu", precision=precision("two_kernel", torch.float16),
                                  lora=lora, **kw)
    err = (got.value - ref.value).abs()
    assert bool((err > 0).any()) and bool((err <= 5.5 * eps(torch.float16) * ref.scale).all())
    assert torch.equal(rnd(got.value, torch.float16), got.value)  # the reduced output is a dt tensor


def test_sharded_forward_rejects_bad_configurations():
    layer, lora = make_layer(9)
    kw = dict(activation="silu", precision=EXACT, lora=lora)
    with pytest.raises(ValueError, match="EP with fully_sharded_loras"):
        sharded_experts_forward(**layer, ep_size=2, fully_sharded=True, **kw)
    with pytest.raises(ValueError, match="not divisible by ep_size=3"):
        sharded_experts_forward(**layer, ep_size=3, **kw)
    with pytest.raises(ValueError, match="I=8 is not divisible by the parallel size 16"):
        sharded_experts_forward(**layer, tp_size=16, fully_sharded=True, **kw)
    with pytest.raises(ValueError, match="tokens_per_rank must be 2 non-negative counts summing to T=7"):
        sharded_experts_forward(**layer, ep_size=2, tokens_per_rank=[3, 3], **kw)
    with pytest.raises(ValueError, match="tp_size > 1 together with ep_size > 1"):
        sharded_experts_forward(**layer, ep_size=2, tp_size=2, **kw)
