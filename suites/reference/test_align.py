"""Tests of reference/align.py: spec 2.2's invariants, vLLM's regression cases, and check_align
catching planted corruptions (while accepting any within-bucket order).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moe_lora_harness.harness.draw.strategies import suite_settings
from moe_lora_harness.reference.align import (
    DEFAULT_FILL,
    active_lora_ids,
    align_alloc,
    align_sizes,
    check_align,
    moe_lora_align_block_size,
)

I32 = torch.int32


def _case(seed, T=20, k=3, E=8, L=3, global_E=None):
    g = torch.Generator().manual_seed(seed)
    n = global_E or E
    topk = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(T)]).to(I32)
    mapping = torch.randint(-1, L, (T,), generator=g).to(I32)
    enabled = torch.ones(L + 1, dtype=I32)
    enabled[L] = 0
    return topk, mapping, enabled


def _run(topk, mapping, E, bs, L, enabled, ids=None, expert_map=None, fill=None):
    ids = active_lora_ids(mapping, L) if ids is None else ids
    s, e, n = align_alloc(topk, bs, E, L, expert_map, fill=fill)
    moe_lora_align_block_size(topk, mapping, E, bs, L, s.shape[1], e.shape[1], s, e, n, enabled, ids, expert_map)
    return s, e, n, ids


def _check_invariants(topk, mapping, E, bs, L, enabled, s, e, n, ids, expert_map=None):
    """Spec 2.2, written out per slot without the reference's vectorized code."""
    T, k = topk.shape
    numel = T * k
    flat = topk.reshape(-1).tolist()
    local = (lambda g: int(expert_map[g]) if 0 <= g < E else -1) if expert_map is not None else (
        lambda g: g if 0 <= g < E else -1)
    for l in {int(v) for v in ids.tolist()}:
        if not (0 <= l < L and int(enabled[l])):
            continue
        pairs = [i for i in range(numel) if int(mapping[i // k]) == l and local(flat[i]) >= 0]
        counts = [0] * E
        for i in pairs:
            counts[local(flat[i])] += 1
        total = sum(-(-c // bs) * bs for c in counts)
        assert int(n[l]) == total  # ntpp = sum of per-expert counts rounded up to the block
        row = s[l].tolist()
        assert sorted(v for v in row if v != numel) == sorted(pairs)  # each pair exactly once
        assert all(v == numel for v in row[total:])  # pad value everywhere past the total
        nb = total // bs
        for b in range(e.shape[1]):
            if b >= nb:
                assert int(e[l, b]) == -1  # -1 past the end
                continue
            for v in row[b * bs:(b + 1) * bs]:
                if v != numel:
                    assert local(flat[v]) == int(e[l, b])  # block membership
        assert e[l, :nb].tolist() == sorted(e[l, :nb].tolist())  # buckets in expert order, contiguous


@suite_settings(max_examples=15)
@given(seed=st.integers(0, 10**6), T=st.integers(1, 24), k=st.integers(1, 4), bs=st.sampled_from([1, 4, 16]),
       L=st.integers(1, 4))
def test_invariants_random(seed, T, k, bs, L):
    E = 8
    topk, mapping, enabled = _case(seed, T=T, k=k, E=E, L=L)
    s, e, n, ids = _run(topk, mapping, E, bs, L, enabled)
    _check_invariants(topk, mapping, E, bs, L, enabled, s, e, n, ids)
    assert check_align(topk, mapping, E, bs, L, s, e, n, enabled, ids) == []


def test_align_sizes_formula():
    assert align_sizes(60, 16, 8) == (60 + 8 * 15, -(-(60 + 8 * 15) // 16))
    assert align_sizes(5, 16, 8) == (5 * 16, 5)  # fewer pairs than experts: numel * block_size
    em = torch.full((64,), -1, dtype=I32)
    assert align_sizes(40, 16, 8, expert_map=em) == (40 * 16, 40)  # kernel_num_experts = expert_map.numel()


def test_active_lora_ids():
    m = torch.tensor([2, -1, 0, 2, 0], dtype=I32)
    assert active_lora_ids(m, 4).tolist() == [-1, 0, 2, -1, -1]
    assert active_lora_ids(torch.tensor([1, 1], dtype=I32), 2).tolist() == [1, -1, -1]
    with pytest.raises(ValueError, match="token_lora_mapping values"):
        active_lora_ids(torch.tensor([3], dtype=I32), 3)


def test_minus_one_first_in_lora_ids_still_aligns_the_rest():
    topk, mapping, enabled = _case(1)
    mapping[0] = -1
    s, e, n, ids = _run(topk, mapping, 8, 4, 3, enabled)
    assert int(ids[0]) == -1
    _check_invariants(topk, mapping, 8, 4, 3, enabled, s, e, n, ids)
    assert int(n.min()) > 0  # every real slot (all used by the mapping) got its rows


def test_disabled_and_out_of_range_slots_are_untouched():
    topk, mapping, enabled = _case(2)
    mapping[:3] = torch.tensor([0, 1, 2], dtype=I32)
    enabled[1] = 0
    ids = torch.tensor([0, 1, 2, 7], dtype=I32)  # 7 >= L: guarded
    s, e, n, _ = _run(topk, mapping, 8, 4, 3, enabled, ids=ids, fill=-99)
    assert bool((s[1] == -99).all()) and int(n[1]) == -99 and bool((e[1] == -1).all())
    assert int(n[0]) > 0 and int(n[2]) > 0
    _check_invariants(topk, mapping, 8, 4, 3, enabled, s, e, n, ids)
    assert check_align(topk, mapping, 8, 4, 3, s, e, n, enabled, ids, untouched_fill=-99) == []


def test_expert_map_global_to_local():
    Eg = 12
    topk, mapping, enabled = _case(3, E=Eg, global_E=Eg)
    expert_map = torch.full((Eg,), -1, dtype=I32)
    expert_map[4:8] = torch.arange(4, dtype=I32)  # this EP rank owns global experts 4..7
    s, e, n, ids = _run(topk, mapping, Eg, 4, 3, enabled, expert_map=expert_map)
    _check_invariants(topk, mapping, Eg, 4, 3, enabled, s, e, n, ids, expert_map=expert_map)
    used = e[e >= 0]
    assert used.numel() > 0 and int(used.max()) < 4  # local ids only
    flat = topk.reshape(-1)
    for v in s[s != topk.numel()].tolist():
        assert 4 <= int(flat[v]) < 8  # non-local pairs dropped


def test_one_and_two_dimensional_buffers_agree():
    topk, mapping, enabled = _case(4)
    s, e, n, ids = _run(topk, mapping, 8, 4, 3, enabled)
    s1, e1 = torch.full((s.numel(),), 5, dtype=I32), torch.full((e.numel(),), -1, dtype=I32)
    n1 = torch.zeros(3, dtype=I32)
    moe_lora_align_block_size(topk, mapping, 8, 4, 3, s.shape[1], e.shape[1], s1, e1, n1, enabled, ids)
    assert torch.equal(s1.view_as(s), s) and torch.equal(e1.view_as(e), e) and torch.equal(n1, n)


def test_reused_buffers_are_fully_rewritten_for_active_slots():
    topk, mapping, enabled = _case(7)
    s, e, n, ids = _run(topk, mapping, 8, 4, 3, enabled)
    s.fill_(12345)
    e.fill_(6)  # stale data from an earlier step: a valid expert id everywhere
    n.fill_(777)
    moe_lora_align_block_size(topk, mapping, 8, 4, 3, s.shape[1], e.shape[1], s, e, n, enabled, ids)
    _check_invariants(topk, mapping, 8, 4, 3, enabled, s, e, n, ids)


# ------------------------------------------------------------------------------------ check_align


def _valid(seed=5, bs=4):
    topk, mapping, enabled = _case(seed, T=24, k=3, E=4)  # ~18 pairs per slot over 4 experts: multi-block buckets
    s, e, n, ids = _run(topk, mapping, 4, bs, 3, enabled, fill=DEFAULT_FILL)
    return topk, mapping, enabled, s, e, n, ids


def _check(topk, mapping, enabled, s, e, n, ids, bs=4):
    return check_align(topk, mapping, 4, bs, 3, s, e, n, enabled, ids, untouched_fill=DEFAULT_FILL)


def test_check_align_accepts_any_order_inside_a_bucket():
    topk, mapping, enabled, s, e, n, ids = _valid()
    l = int(ids[ids >= 0][0])
    e0 = int(e[l, 0])
    blocks = int((e[l] == e0).sum())
    assert blocks >= 2  # the bucket spans several blocks, so a reversal moves pairs across blocks
    s2 = s.clone()
    s2[l, : blocks * 4] = s[l, : blocks * 4].flip(0)
    assert _check(topk, mapping, enabled, s2, e, n, ids) == []


@pytest.mark.parametrize("corrupt, text", [
    ("ntpp", "num_tokens_post_pad"),
    ("expert", "experts_ids differ"),
    ("swap_buckets", "missing"),
    ("duplicate", "unexpected"),
    ("tail", "past the padded total"),
    ("skipped_written", "skipped"),
])
def test_check_align_catches_planted_corruptions(corrupt, text):
    topk, mapping, enabled, s, e, n, ids = _valid()
    enabled[2] = 0  # slot 2 skipped: its rows must stay at the sentinel
    s, e, n, ids = _run(topk, mapping, 4, 4, 3, enabled, fill=DEFAULT_FILL)
    assert _check(topk, mapping, enabled, s, e, n, ids) == []
    s, e, n = s.clone(), e.clone(), n.clone()
    numel = topk.numel()
    if corrupt == "ntpp":
        n[0] += 4
    elif corrupt == "expert":
        e[0, 0] = (int(e[0, 0]) + 1) % 4
    elif corrupt == "swap_buckets":  # a pair moved into another expert's bucket
        first = int(s[0, 0])
        last_bucket = int(n[0]) - 4
        j = next(i for i in range(last_bucket, int(n[0])) if int(s[0, i]) != numel)
        s[0, 0], s[0, j] = s[0, j].clone(), first
    elif corrupt == "duplicate":
        s[0, 1] = s[0, 0]
    elif corrupt == "tail":
        s[0, -1] = 0
    else:
        n[2] = 0
    msgs = _check(topk, mapping, enabled, s, e, n, ids)
    assert msgs and any(text in m for m in msgs), msgs


@pytest.mark.parametrize("call, exc, text", [
    (lambda a: dict(topk=a["topk"].long()), TypeError, "topk_ids must be an int32"),
    (lambda a: dict(bs=0), ValueError, "block_size"),
    (lambda a: dict(E=1000), ValueError, "1024"),
    (lambda a: dict(s=a["s"][:, :-1]), ValueError, "sorted_token_ids must have shape"),
    (lambda a: dict(n=a["n"][:-1]), ValueError, "num_tokens_post_pad"),
    (lambda a: dict(m=a["m"][:-1]), ValueError, "token_lora_mapping"),
    (lambda a: dict(M=4), ValueError, "needs"),
    (lambda a: dict(em=torch.zeros(3, dtype=I32)), ValueError, "expert_map"),
])
def test_bad_arguments_raise(call, exc, text):
    topk, mapping, enabled = _case(6)
    s, e, n = align_alloc(topk, 4, 8, 3)
    a = dict(topk=topk, m=mapping, E=8, bs=4, L=3, s=s, e=e, n=n, M=s.shape[1], MB=e.shape[1], em=None)
    a.update(call(a))
    if a["M"] != s.shape[1]:
        a["s"] = s[:, : a["M"]].contiguous()
    with pytest.raises(exc, match=text):
        moe_lora_align_block_size(a["topk"], a["m"], a["E"], a["bs"], a["L"], a["M"], a["MB"], a["s"], a["e"],
                                  a["n"], enabled, active_lora_ids(mapping, 3), a["em"])
