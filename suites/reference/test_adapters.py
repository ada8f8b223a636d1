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


# ----------------------------------------------------------------------------- per-module ranks and scalings


def _exact_adapter(r13: int, r2: int, scaling: float, down_scaling: float | None, gated: bool = True,
                   offset: int = 0) -> ExpertAdapter:
    """Factors from exact rationals (no RNG: the same bits under any torch build), float32."""
    def t(*shape):
        n = int(torch.tensor(shape).prod())
        v = ((torch.arange(n, dtype=torch.float64) * 7 + offset) % 97 - 48) / 37
        return v.reshape(shape).to(torch.float32)
    return ExpertAdapter(t(E, r13, H), t(E, I, r13), t(E, r13, H) if gated else None,
                         t(E, I, r13) if gated else None, t(E, r2, I), t(E, H, r2), scaling, down_scaling)


def _digest(st: StackedMoELoRA) -> str:
    import hashlib
    h = hashlib.sha256()
    for t in (*st.w13_a, *st.w13_b, *st.w2_a, *st.w2_b, st.adapter_enabled):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def test_single_rank_adapter_packs_bit_identically_to_before():
    """Digests of the buffers packed by the single-rank, single-scaling pack_moe_lora (git eed3c6c) from the
    same exact factors: a one-rank adapter without down_scaling packs to the same bits today."""
    ads = [_exact_adapter(3, 3, 0.37, None), None, _exact_adapter(R, R, 1.7, None, offset=5)]
    got = {str(dt): _digest(_pack(ads, dtype=dt)) for dt in (torch.bfloat16, torch.float16, torch.float32)}
    assert got == {"torch.bfloat16": "e379982db926db14", "torch.float16": "dc5e38d1526756b1",
                   "torch.float32": "9e9f0d198e3930db"}
    # down_scaling equal to scaling is the same adapter
    same = [_exact_adapter(3, 3, 0.37, 0.37), None, _exact_adapter(R, R, 1.7, 1.7, offset=5)]
    assert _digest(_pack(same, dtype=torch.bfloat16)) == got["torch.bfloat16"]


def test_per_module_rank_and_scaling_land_in_their_own_buffers():
    ad = _exact_adapter(6, 3, 0.37, 2.5)      # gate_up rank 2r with its scaling, down rank r with its own
    assert (ad.w13_rank, ad.w2_rank, ad.rank, ad.w2_scaling) == (6, 3, 6, 2.5)
    st = _pack([ad], dtype=torch.bfloat16)
    bf = torch.bfloat16
    assert torch.equal(st.w13_a[0][0, :, :6], ad.gate_a.to(bf)) and torch.equal(st.w13_a[1][0, :, :6], ad.up_a.to(bf))
    assert torch.equal(st.w13_b[0][0, ..., :6], ad.gate_b.to(bf) * 0.37)
    assert torch.equal(st.w13_b[1][0, ..., :6], ad.up_b.to(bf) * 0.37)
    assert torch.equal(st.w2_a[0][0, :, :3], ad.down_a.to(bf))
    assert torch.equal(st.w2_b[0][0, ..., :3], ad.down_b.to(bf) * 2.5)
    # each module's padding beyond its own rank is exactly zero
    for t in (st.w13_a[0][0, :, 6:], st.w13_b[1][0, ..., 6:], st.w2_a[0][0, :, 3:], st.w2_b[0][0, ..., 3:]):
        assert t.numel() and bool((t == 0).all())
    # the other way round: the w2 scaling is not the w13 one (a swapped fold would be caught)
    assert not torch.equal(st.w2_b[0][0, ..., :3], ad.down_b.to(bf) * 0.37)
    assert not torch.equal(st.w13_b[0][0, ..., :6], ad.gate_b.to(bf) * 2.5)
    # a larger down rank works the same way, and the largest rank must fit max_rank
    wide = _exact_adapter(2, 5, 1.0, 0.5)
    st2 = _pack([wide], dtype=torch.float32)
    assert torch.equal(st2.w2_b[0][0, ..., :5], wide.down_b * 0.5) and bool((st2.w13_a[0][0, :, 2:] == 0).all())
    with pytest.raises(ValueError, match=r"adapters\[0\] has rank 9 > max_rank=8 \(w13 rank 2, w2 rank 9\)"):
        _pack([_exact_adapter(2, 9, 1.0, None)])
    bad = _exact_adapter(6, 3, 1.0, None)
    bad.up_a = bad.up_a[:, :5]
    with pytest.raises(ValueError, match=r"adapters\[0\].up_a must have shape \(3, 6, 16\), got \(3, 5, 16\)"):
        _pack([bad])


def test_random_adapter_down_rank_and_scaling():
    ad = ExpertAdapter.random(E, H, I, 6, True, 0.5, _gen(13), down_rank=2, down_scaling=4.0)
    assert (ad.w13_rank, ad.w2_rank, ad.rank, ad.scaling, ad.w2_scaling) == (6, 2, 6, 0.5, 4.0)
    assert ad.down_a.shape == (E, 2, I) and ad.down_b.shape == (E, H, 2) and ad.up_b.shape == (E, I, 6)
    # the default draws are unchanged by the new keywords (same generator stream, same order)
    plain = ExpertAdapter.random(E, H, I, 4, True, 0.5, _gen(14))
    explicit = ExpertAdapter.random(E, H, I, 4, True, 0.5, _gen(14), down_rank=4, device=None)
    for f in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        assert torch.equal(getattr(plain, f), getattr(explicit, f))
    assert plain.down_scaling is None and plain.w2_scaling == 0.5
    with pytest.raises(ValueError, match="down_rank must be a positive int"):
        ExpertAdapter.random(E, H, I, 4, True, down_rank=0)


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_device_keyword_makes_factors_and_buffers_there(device):
    """`device` draws the factors with that device's generator and makes the buffers there; on the CPU it is
    today's behaviour bit for bit."""
    ad = ExpertAdapter.random(E, H, I, 4, True, 0.5, torch.Generator(device).manual_seed(15), device=device)
    assert ad.gate_a.device.type == device and ad.down_b.device.type == device
    st = _pack([ad, None], dtype=torch.bfloat16, device=device)
    for t in (*st.w13_a, *st.w13_b, *st.w2_a, *st.w2_b, st.adapter_enabled):
        assert t.device.type == device
    cpu_ad = ExpertAdapter(*(None if t is None else t.cpu() for t in
                             (ad.gate_a, ad.gate_b, ad.up_a, ad.up_b, ad.down_a, ad.down_b)), ad.scaling)
    on_cpu = StackedMoELoRA(*([t.cpu() for t in bufs] for bufs in (st.w13_a, st.w13_b, st.w2_a, st.w2_b)),
                            st.adapter_enabled.cpu())
    assert _digest(on_cpu) == _digest(_pack([cpu_ad, None], dtype=torch.bfloat16))
    if device == "cpu":
        old = ExpertAdapter.random(E, H, I, 4, True, 0.5, _gen(15))
        assert torch.equal(old.gate_a, ad.gate_a) and torch.equal(old.down_b, ad.down_b)
