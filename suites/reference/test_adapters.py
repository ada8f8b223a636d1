"""Tests of reference/adapters.py: packing adapters into the stacked MoE LoRA buffers (spec 4.1)."""

import pytest
import torch

from moe_lora_harness.reference.adapters import ExpertAdapter, StackedMoELoRA, pack_moe_lora

E, H, I, L, R = 3, 16, 8, 3, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pack(adapters, dtype=torch.float16, gated=True, **kw):
    return pack_moe_lora(adapters, max_loras=L, max_rank=R, num_experts=E, hidden_size=H,
                         intermediate_size=I, dtype=dtype, gated=gated, **kw)


def test_random_adapter_shapes_and_nontrivial():
    ad = ExpertAdapter.random(E, H, I, 4, True, 0.5, _gen(0))
    assert ad.rank == 4 and ad.gated
    assert ad.gate_a.shape == (E, 4, H) and ad.up_b.shape == (E, I, 4)
    assert ad.down_a.shape == (E, 4, I) and ad.down_b.shape == (E, H, 4)
    for t in (ad.gate_a, ad.gate_b, ad.up_a, ad.up_b, ad.down_a, ad.down_b):
        assert bool((t != 0).all())
    # B A x keeps the magnitude of x (A ~ 1/sqrt(in), B ~ 1/sqrt(rank)): a LoRA delta that matters
    x = torch.randn(64, H, generator=_gen(1), dtype=torch.float64)
    d = torch.einsum("nr,rh,th->tn", ad.gate_b[0].double(), ad.gate_a[0].double(), x)
    assert 0.2 < d.std().item() < 5.0
    non_gated = ExpertAdapter.random(E, H, I, 4, False, 1.0, _gen(0))
    assert non_gated.up_a is None and non_gated.up_b is None and not non_gated.gated


def test_pack_layout_padding_and_enabled():
    a0 = ExpertAdapter.random(E, H, I, 3, True, 1.0, _gen(2))  # rank 3 < R: zero-padded
    a2 = ExpertAdapter.random(E, H, I, R, True, 1.0, _gen(3))
    st = _pack([a0, None, a2], dtype=torch.float32)
    assert isinstance(st, StackedMoELoRA)
    assert (st.max_loras, st.max_rank, st.num_slices, st.num_experts) == (L, R, 2, E)
    assert not st.shared_a and not st.shared_b
    assert st.adapter_enabled.dtype == torch.int32
    assert st.adapter_enabled.tolist() == [1, 0, 1, 0]  # entry L is never set
    # slice 0 = gate (w1), slice 1 = up (w3); top-left corner copy, the rest exactly 0
    assert torch.equal(st.w13_a[0][0, :, :3, :], a0.gate_a)
    assert torch.equal(st.w13_a[1][0, :, :3, :], a0.up_a)
    assert torch.equal(st.w13_b[0][0, :, :, :3], a0.gate_b)
    assert torch.equal(st.w13_b[1][0, :, :, :3], a0.up_b)
    assert torch.equal(st.w2_a[0][0, :, :3, :], a0.down_a)
    assert torch.equal(st.w2_b[0][0, :, :, :3], a0.down_b)
    for t in (st.w13_a[0][0, :, 3:], st.w2_a[0][0, :, 3:], st.w13_b[1][0, ..., 3:], st.w2_b[0][0, ..., 3:]):
        assert bool((t == 0).all())
    # the empty slot is all zeros; the full-rank slot is copied whole
    for bufs in (st.w13_a, st.w13_b, st.w2_a, st.w2_b):
        assert bool((bufs[0][1] == 0).all())
    assert torch.equal(st.w2_b[0][2], a2.down_b)


def test_scaling_folded_into_b_in_lora_dtype():
    """B is cast to the LoRA dtype first, then multiplied by `scaling` in that dtype (spec 4.1)."""
    s = 0.37
    ad = ExpertAdapter.random(E, H, I, R, True, s, _gen(4), dtype=torch.float32)
    st = _pack([ad], dtype=torch.bfloat16)
    for packed, src in ((st.w13_b[0][0], ad.gate_b), (st.w13_b[1][0], ad.up_b), (st.w2_b[0][0], ad.down_b)):
        assert packed.dtype == torch.bfloat16
        assert torch.equal(packed, src.to(torch.bfloat16) * s)
        # folding before the cast would round differently somewhere: the order is observable
        assert not torch.equal(packed, (src * s).to(torch.bfloat16))
    # A is never scaled
    assert torch.equal(st.w13_a[0][0], ad.gate_a.to(torch.bfloat16))
    assert torch.equal(st.w2_a[0][0], ad.down_a.to(torch.bfloat16))


def test_shared_factors_keep_expert_zero():
    ad = ExpertAdapter.random(E, H, I, R, True, 2.0, _gen(5))
    st = _pack([ad], dtype=torch.float32, shared_a=True, shared_b=True)
    assert st.w13_a[0].shape == (L, 1, R, H) and st.w2_b[0].shape == (L, 1, H, R)
    assert st.shared_a and st.shared_b
    assert torch.equal(st.w13_a[0][0, 0], ad.gate_a[0]) and torch.equal(st.w13_a[1][0, 0], ad.up_a[0])
    assert torch.equal(st.w2_b[0][0, 0], ad.down_b[0] * 2.0)
    # the other factors stay per expert
    assert st.w13_b[0].shape == (L, E, I, R) and st.w2_a[0].shape == (L, E, R, I)
    only_a = _pack([ad], dtype=torch.float32, shared_a=True)
    assert only_a.shared_a and not only_a.shared_b


def test_non_gated_single_slice():
    ad = ExpertAdapter.random(E, H, I, 4, False, 1.0, _gen(6))
    st = _pack([ad, None], gated=False)
    assert st.num_slices == 1 and len(st.w13_b) == 1
    assert torch.equal(st.w13_a[0][0, :, :4], ad.gate_a.to(torch.float16))
    # a gated adapter packed for a non-gated model: its up factors are ignored (vLLM drops w3)
    gated_ad = ExpertAdapter.random(E, H, I, 4, True, 1.0, _gen(7))
    st2 = _pack([gated_ad], gated=False)
    assert st2.num_slices == 1 and torch.equal(st2.w13_b[0][0, :, :, :4], gated_ad.gate_b.to(torch.float16))


def test_pack_errors_name_the_argument():
    ad = ExpertAdapter.random(E, H, I, 4, True, 1.0, _gen(8))
    with pytest.raises(ValueError, match="rank 9 > max_rank=8"):
        _pack([ExpertAdapter.random(E, H, I, 9, True, 1.0, _gen(9))])
    with pytest.raises(ValueError, match="max_loras=3"):
        _pack([ad, ad, ad, ad])
    with pytest.raises(ValueError, match=r"adapters\[0\].gate_a must have shape \(3, 4, 16\)"):
        _pack([ExpertAdapter.random(E, H + 1, I, 4, True, 1.0, _gen(10))])
    with pytest.raises(ValueError, match=r"adapters\[1\].down_b"):
        bad = ExpertAdapter.random(E, H, I, 4, True, 1.0, _gen(11))
        bad.down_b = bad.down_b[:, :-1]
        _pack([None, bad])
    with pytest.raises(ValueError, match="up_a/up_b are None but gated=True"):
        _pack([ExpertAdapter.random(E, H, I, 4, False, 1.0, _gen(12))], gated=True)
    with pytest.raises(ValueError, match="max_rank must be a positive int"):
        pack_moe_lora([ad], max_loras=L, max_rank=0, num_experts=E, hidden_size=H, intermediate_size=I,
                      dtype=torch.float16, gated=True)
    with pytest.raises(TypeError, match=r"adapters\[0\] must be an ExpertAdapter"):
        _pack(["not an adapter"])
    with pytest.raises(TypeError, match="dtype must be a floating"):
        _pack([ad], dtype=torch.int32)
